"""Lightning in one line each: `Trainer(callbacks=[TransomCallback()],
plugins=[TransomCheckpointIO()])`.

`TransomCallback` reports each optimizer step to the node agent with Lightning's own step number
(`trainer.global_step`) and the training loss (`training_step`'s returned loss, averaged over
gradient-accumulation batches), so NaN/Inf and loss spikes are found at their step; the zero-code
hooks (transom.monitor.auto) still time the step and its wait in collectives.

`TransomCheckpointIO` makes Lightning's checkpoints go through transom.checkpoint: the state
goes to the node's checkpoint memory (then a peer's memory and storage, in the background), and
the file Lightning asked for holds only a small marker naming the step, so `ModelCheckpoint`,
`ckpt_path=...` and its clean-up work as before. Loading reads the step back from the fastest
tier that holds it (local memory, a peer, storage). `resume_path(dirpath)` gives the `ckpt_path`
for the step the controller chose to restore (TRANSOM_RESTORE_STEP), or None for a fresh start.
Lightning saves from global rank 0 only; the state is saved as identical on every rank
(`replicated=("",)`), as it is under DDP.

What they must never do: raise into training from a report (the callback swallows its errors),
or pretend a save happened (a save the engine refuses raises, as a failed torch.save would).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.io import CheckpointIO

from transom.common import env
from transom.integrations import steps

MARKER_KEY = "transom_step"


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


class TransomCheckpointIO(CheckpointIO):
    """Lightning checkpoints through transom.checkpoint: memory first, storage in the background."""

    def __init__(self, engine: Any = None, persist: bool = True) -> None:
        """`engine`: a transom.checkpoint.Engine of the caller's (default: one made on first
        use, under `transom run` on the node's checkpoint server, and closed at teardown)."""
        self._engine = engine
        self._owned = engine is None
        self.persist = persist

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
        handle = self.engine.save(step, checkpoint, replicated=("",), persist=self.persist)
        if not handle.ok:
            raise OSError(f"transom checkpoint of step {step} refused: {handle.error}")
        write_marker(Path(path), step)

    def load_checkpoint(
        self, path: str | Path, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        step = read_marker(Path(path))
        state = self.engine.load(step=step, map_location=map_location)
        if state is None:
            raise FileNotFoundError(f"no transom checkpoint of step {step} (marker {path})")
        return state

    def remove_checkpoint(self, path: str | Path) -> None:
        """Lightning's clean-up removes the marker; the engine keeps its own newest steps."""
        Path(path).unlink(missing_ok=True)

    def teardown(self) -> None:
        if self._owned and self._engine is not None:
            self._engine.close()
            self._engine = None


def write_marker(path: Path, step: int) -> None:
    """Write the marker atomically; ranks sharing a file system may write the same one at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({MARKER_KEY: step}))
    os.replace(tmp, path)


def read_marker(path: Path) -> int:
    """The step a marker names; ValueError for a file that is not one (a plain checkpoint)."""
    try:
        step = json.loads(path.read_text())[MARKER_KEY]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a transom checkpoint marker: {e}") from e
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{path}: bad step {step!r}")
    return step


def resume_path(dirpath: str | Path) -> str | None:
    """The `ckpt_path` for the step the controller chose (TRANSOM_RESTORE_STEP), or None."""
    text = os.environ.get(env.RESTORE_STEP)
    if not text or not text.isdigit():
        return None
    path = Path(dirpath) / f"transom-restore-step={int(text)}.ckpt"
    write_marker(path, int(text))
    return str(path)
