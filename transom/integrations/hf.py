"""Hugging Face `Trainer` in one line: `Trainer(..., callbacks=[TransomCallback()])`, and its
checkpoints through transom.checkpoint in two: `TransomCheckpoints()` among the callbacks and
`trainer.train(resume_from_checkpoint=resume_checkpoint(args.output_dir))`.

The callback reports each optimizer step to the node agent with the Trainer's own step number
(`state.global_step`, which a resumed Trainer continues) and that step's training loss, so the
agent's numerics detector finds a NaN/Inf or a spiking loss at its step and the controller rolls
back (transom.control.policy), while the zero-code hooks (transom.monitor.auto) still time the
step and its wait in collectives. The loss is taken from the model's own output (a forward hook:
`outputs.loss` in training mode, averaged over gradient-accumulation micro-batches), so no
`logging_steps=1` is needed; reading it costs one `.item()` a micro-batch.

`TransomCheckpoints` snapshots the Trainer's state after every optimizer step through
transom.checkpoint (hf_state.py: on rank 0 the model, optimizer, scheduler and trainer state,
on every rank its RNG state; copied to node memory while the next step runs, a peer's memory
behind it, storage at the Trainer's own save steps), so a restart loses at most the step in
flight; a step whose loss was not finite on this rank (as `TransomCallback`, listed before it,
reported) is not snapshotted, so a rollback finds the step before a NaN. With
`every_step=False` it sends each rank's files of every checkpoint folder the Trainer saves
instead. `resume_checkpoint(output_dir)` writes the newest step every rank holds at or after
the one the controller chose (TRANSOM_RESTORE_STEP; before a NaN's step after a rollback) back
as a checkpoint folder of this rank's own, in the Trainer's formats, from the fastest tier that
holds it, and returns its path for the Trainer's own resume (weights, optimizer, RNG, data
position); None for a fresh start.

What it must never do: change the Trainer's control flow or raise into training from a report
(every hook swallows its errors; without Transom it does nothing but its bookkeeping).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from transom.common import env
from transom.integrations import hf_state, steps

log = logging.getLogger("transom.hf")

FILES = "files"
STEP = "step"  # the Trainer's global step, in every shard (the step `resume_checkpoint` wrote)
_RNG = re.compile(r"rng_state(_\d+)?\.pth$")
_engine: Any = None


def engine() -> Any:
    """This process's transom.checkpoint.Engine (under `transom run`, on the node's server)."""
    global _engine
    if _engine is None:
        from transom import checkpoint

        _engine = checkpoint.Engine()
    return _engine


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _own_file(name: str, rank: int) -> bool:
    """Rank 0 sends the whole folder but the other ranks' RNG states; others their RNG state."""
    if _RNG.fullmatch(name):
        return name in (f"rng_state_{rank}.pth", "rng_state.pth")
    return rank == 0


class TransomCallback(TrainerCallback):
    """Reports the Trainer's steps and losses to Transom's monitor."""

    def __init__(self) -> None:
        self._losses: list[Any] = []
        self._handle: Any = None
        self._began: float | None = None

    def _capture(self, module: Any, inputs: Any, output: Any) -> None:
        try:
            if not module.training:
                return  # an evaluation's forward: not a training step's loss
            loss = output.get("loss") if hasattr(output, "get") else None
            if loss is None:
                loss = getattr(output, "loss", None)
            if loss is not None and hasattr(loss, "detach"):
                self._losses.append(loss.detach())
        except Exception:  # noqa: BLE001
            pass

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        steps.attach()
        model = kwargs.get("model")
        if self._handle is None and model is not None:
            try:
                self._handle = model.register_forward_hook(self._capture)
            except Exception:  # noqa: BLE001
                self._handle = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._began is None:
            self._began = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        duration = now - self._began if self._began is not None else None
        self._began = now  # the next step begins as this one ends (data loading included)
        losses, self._losses = self._losses, []
        steps.report_step(state.global_step, steps.mean_loss(losses), duration)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class TransomCheckpoints(TrainerCallback):
    """Snapshots the Trainer's state every step through transom.checkpoint (`every_step`, the
    default), or sends every checkpoint folder the Trainer saves through it."""

    def __init__(self, every_step: bool = True, overlap: bool = True) -> None:
        self.every_step = every_step
        self.overlap = overlap  # False for a model whose forward changes its buffers

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.every_step:
            return
        step = int(state.global_step)
        if not steps.finite(step):
            return  # a NaN's step: the rollback restores the one before it
        try:
            part = hf_state.snapshot(
                state,
                kwargs.get("model"),
                kwargs.get("optimizer"),
                kwargs.get("lr_scheduler"),
                _rank(),
                int(args.world_size),
            )
            handle = engine().save(
                step, {**part, STEP: step}, persist=control.should_save, overlap=self.overlap
            )
        except (TypeError, ValueError, AttributeError) as e:  # UnsupportedValue is a TypeError
            # A state the engine cannot hold: the Trainer's own checkpoint folders go instead.
            log.warning(
                "transom cannot snapshot this Trainer's state (%s): sending its "
                "checkpoint folders instead",
                e,
            )
            self.every_step = False
            return
        if not handle.ok:
            log.warning("transom snapshot of step %d refused: %s", step, handle.error)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.every_step:
            return  # its step's snapshot went at on_step_end, to storage too
        step = int(state.global_step)
        folder = Path(args.output_dir) / f"checkpoint-{step}"
        rank = _rank()
        files = {
            f.name: torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8)
            for f in sorted(folder.iterdir())
            if f.is_file() and _own_file(f.name, rank)
        }
        handle = engine().save(step, {FILES: files, STEP: step})
        if not handle.ok:
            raise OSError(f"transom checkpoint of step {step} refused: {handle.error}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        global _engine
        if _engine is not None:
            _engine.close()
            _engine = None


def resume_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The checkpoint folder to resume from: the newest step every rank holds at or after the
    controller's restore step, written back from transom.checkpoint into
    OUTPUT_DIR/transom-restore/rankR/checkpoint-N; None when the plan names no step (a fresh
    start)."""
    text = os.environ.get(env.RESTORE_STEP)
    if not text or not text.isdigit():
        return None
    rank = _rank()
    own = engine().load()  # the same step on every rank (checkpoint/agreement.py)
    step = own.get(STEP) if isinstance(own, dict) else None
    if not isinstance(step, int):  # saved without its step: the plan's
        step = int(text)
        own = engine().load(step=step)
    zero = own if rank == 0 else engine().load(step=step, rank=0)
    folder = Path(output_dir) / "transom-restore" / f"rank{rank}" / f"checkpoint-{step}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    # Each part a snapshot (hf_state.py) or a folder's files (`every_step=False`, or a rank whose
    # state could not be snapshotted): rank 0's holds the state, this rank's its RNG.
    for shard, part in ((zero, "model"), (own, "rng")):
        if not isinstance(shard, dict) or (part not in shard and FILES not in shard):
            raise FileNotFoundError(f"no transom checkpoint of step {step} for rank {rank}")
        if part == "model" and part in shard:
            hf_state.write_state(folder, shard)
        elif part == "rng" and part in shard:
            hf_state.write_rng(folder, shard, rank)
        else:
            for name, data in shard[FILES].items():
                rng = _RNG.fullmatch(name) is not None
                if (not rng) if part == "model" else (rng and _own_file(name, rank)):
                    (folder / os.path.basename(name)).write_bytes(data.numpy().tobytes())
    return str(folder)
