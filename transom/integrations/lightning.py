"""Lightning in one line each: `Trainer(callbacks=[TransomCallback(), TransomCheckpoints()],
plugins=[TransomCheckpointIO()])`.

`TransomCallback` reports each optimizer step to the node agent with Lightning's own step number
(`trainer.global_step`) and the training loss (`training_step`'s returned loss, averaged over
gradient-accumulation batches), so NaN/Inf and loss spikes are found at their step; the zero-code
hooks (transom.monitor.auto) still time the step and its wait in collectives.

`TransomCheckpointIO` makes Lightning's checkpoints go through transom.checkpoint: the state
goes to the node's checkpoint memory (then a peer's memory and storage, in the background), and
the file Lightning asked for holds only a small marker naming the step, so `ModelCheckpoint`,
`ckpt_path=...` and its clean-up work as before. Loading reads the step back from the fastest
tier that holds it (local memory, a peer, storage).

`TransomCheckpoints` snapshots Lightning's whole checkpoint (what `Trainer.save_checkpoint`
would write: weights, optimizer, loops, callbacks) after every optimizer step, copied into node
memory while the next step runs (the next optimizer step waits for the copy), a peer's memory
behind it, so a restart loses at most the step in flight. A step whose loss was not finite on
this rank (as `TransomCallback`, listed before it, reported) is not snapshotted. When
ModelCheckpoint then saves a snapshotted step, the plugin sends the snapshot to storage instead
of saving the step again (the snapshot is the state as the step ended, before validation and
epoch-end hooks: resuming from it runs those again). Data order after a restore is Lightning's:
exact mid-epoch only with a resumable data loader (`state_dict`/`load_state_dict`) or data
chosen by the step.

`resume_path(dirpath)` gives the `ckpt_path` to restore from: the newest step every rank holds
at or after the one the controller chose (TRANSOM_RESTORE_STEP; before a NaN's step after a
rollback), agreed over the process group when Lightning loads it; None for a fresh start.
Lightning saves from global rank 0 only; the state is saved as identical on every rank
(`replicated=("",)`), as it is under DDP.

What they must never do: raise into training from a report (the callback swallows its errors),
or pretend a save happened (a save the engine refuses raises, as a failed torch.save would).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.io import CheckpointIO

from transom.common import env
from transom.integrations import steps

log = logging.getLogger("transom.lightning")

MARKER_KEY = "transom_step"
NEWEST_KEY = "newest"  # a restore marker: the newest step every rank holds at or after the step
SNAPSHOTS_KEPT = 4  # the newest snapshots' handles the plugin keeps, to persist one


class TransomCallback(pl.Callback):
    """Reports Lightning's steps and training losses to Transom's monitor."""

    def __init__(self) -> None:
        self._losses: list[Any] = []
        self._step: int | None = None
        self._began: float | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        steps.attach()
        self._step = int(trainer.global_step)
        self._began = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        try:
            loss = outputs.get("loss") if hasattr(outputs, "get") else outputs
            if loss is not None:
                self._losses.append(loss.detach() if hasattr(loss, "detach") else loss)
            step = int(trainer.global_step)
            if step == self._step:
                return  # accumulating gradients: no optimizer step yet
            self._step = step
            now = time.perf_counter()
            duration = now - self._began if self._began is not None else None
            self._began = now
            losses, self._losses = self._losses, []
            steps.report_step(step, steps.mean_loss(losses), duration)
        except Exception:  # noqa: BLE001 - monitoring must never break training
            pass


class TransomCheckpoints(pl.Callback):
    """Snapshots Lightning's checkpoint after every optimizer step (on global rank 0, through
    the `TransomCheckpointIO` plugin's engine); `overlap=False` for a model whose forward
    changes its buffers (the copy then blocks for its whole length)."""

    def __init__(self, overlap: bool = True) -> None:
        self.overlap = overlap
        self.enabled = True
        self._step: int | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._step = int(trainer.global_step)  # restored, not taken again

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = int(trainer.global_step)
        if not self.enabled or step == self._step or trainer.global_rank != 0:
            return  # accumulating gradients: no optimizer step yet
        self._step = step
        if not steps.finite(step):
            return  # a NaN's step: the rollback restores the one before it
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, TransomCheckpointIO):
            log.warning("TransomCheckpoints needs plugins=[TransomCheckpointIO()]: no snapshots")
            self.enabled = False
            return
        try:
            state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            handle = io.engine.save(
                step, state, replicated=("",), persist=False, overlap=self.overlap
            )
        except (TypeError, ValueError, AttributeError) as e:  # UnsupportedValue is a TypeError
            log.warning("transom cannot snapshot this Trainer's state (%s): no snapshots", e)
            self.enabled = False
            return
        if handle.ok:
            io.snapshots[step] = handle
            for old in sorted(io.snapshots)[:-SNAPSHOTS_KEPT]:
                del io.snapshots[old]
        else:
            log.warning("transom snapshot of step %d refused: %s", step, handle.error)


class TransomCheckpointIO(CheckpointIO):
    """Lightning checkpoints through transom.checkpoint: memory first, storage in the background."""

    def __init__(self, engine: Any = None, persist: bool = True) -> None:
        """`engine`: a transom.checkpoint.Engine of the caller's (default: one made on first
        use, under `transom run` on the node's checkpoint server, and closed at teardown)."""
        self._engine = engine
        self._owned = engine is None
        self.persist = persist
        self.snapshots: dict[int, Any] = {}  # step -> TransomCheckpoints' save handle

    @property
    def engine(self) -> Any:
        """Lightning saves the whole checkpoint from global rank 0 and every rank loads it all
        (DDP: the same state everywhere), so the engine holds it as the one rank of a world of
        one, marked the same on every rank (`replicated=("",)`): a step is then complete with
        that one shard, and any rank reads it back whole."""
        if self._engine is None:
            from transom import checkpoint

            self._engine = checkpoint.Engine(rank=0, world_size=1)
        return self._engine

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None
    ) -> None:
        step = int(checkpoint["global_step"])
        snapshot = self.snapshots.pop(step, None)
        if snapshot is not None:  # in memory already: to storage too, not saved twice
            if self.persist:
                try:
                    snapshot.persist()
                except Exception as e:  # noqa: BLE001 - SaveRefused, CheckpointError
                    raise OSError(f"transom checkpoint of step {step} not persisted: {e}") from e
        else:
            handle = self.engine.save(step, checkpoint, replicated=("",), persist=self.persist)
            if not handle.ok:
                raise OSError(f"transom checkpoint of step {step} refused: {handle.error}")
        write_marker(Path(path), step)

    def load_checkpoint(
        self, path: str | Path, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        step, newest = _read(Path(path))
        if newest:
            return self._load_newest(step, map_location)
        state = self.engine.load(step=step, map_location=map_location)
        if state is None:
            raise FileNotFoundError(f"no transom checkpoint of step {step} (marker {path})")
        return state

    def _load_newest(self, floor: int, map_location: Any) -> dict[str, Any]:
        """The newest step every rank holds at or after `floor` (the plan's), then older ones
        restorable, agreed over Lightning's process group (checkpoint/agreement.py)."""
        import torch.distributed as dist

        from transom.checkpoint import agreement

        engine = self.engine
        candidates = engine.restore_candidates(floor)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        agreed = agreement.agree(
            candidates,
            lambda s: engine.load(step=s, map_location=map_location),
            world,
            engine.storage_dir,
        )
        if agreed is None:
            raise FileNotFoundError(f"no transom checkpoint of step {floor} or later")
        return dict(agreed[1])

    def remove_checkpoint(self, path: str | Path) -> None:
        """Lightning's clean-up removes the marker; the engine keeps its own newest steps."""
        Path(path).unlink(missing_ok=True)

    def teardown(self) -> None:
        if self._owned and self._engine is not None:
            self._engine.close()
            self._engine = None


def write_marker(path: Path, step: int, newest: bool = False) -> None:
    """Write the marker atomically; ranks sharing a file system may write the same one at once.
    `newest`: a restore marker (the newest step every rank holds at or after `step`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({MARKER_KEY: step, **({NEWEST_KEY: True} if newest else {})}))
    os.replace(tmp, path)


def read_marker(path: Path) -> int:
    """The step a marker names; ValueError for a file that is not one (a plain checkpoint)."""
    return _read(path)[0]


def _read(path: Path) -> tuple[int, bool]:
    """A marker's step, and whether it asks for the newest step held at or after it."""
    try:
        marker = json.loads(path.read_text())
        step = marker[MARKER_KEY]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a transom checkpoint marker: {e}") from e
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{path}: bad step {step!r}")
    return step, marker.get(NEWEST_KEY) is True


def resume_path(dirpath: str | Path) -> str | None:
    """The `ckpt_path` to restore from: the newest step every rank holds at or after the one
    the controller chose (TRANSOM_RESTORE_STEP), agreed when Lightning loads it; or None."""
    text = os.environ.get(env.RESTORE_STEP)
    if not text or not text.isdigit():
        return None
    path = Path(dirpath) / f"transom-restore-step={int(text)}.ckpt"
    write_marker(path, int(text), newest=True)
    return str(path)
