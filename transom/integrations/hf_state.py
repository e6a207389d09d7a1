"""A Hugging Face `Trainer`'s state as an in-memory snapshot, and back as a checkpoint folder.

`snapshot` takes what the Trainer's own checkpoint holds, as tensors and plain values for
transom.checkpoint (no pickling, no files): on global rank 0 the model's and optimizer's state
dicts, the scheduler's and the trainer state (as its JSON), on every rank its RNG states (the
Python generator's 625 numbers as one tensor). `write_state` and `write_rng` turn snapshots back
into the folder the Trainer resumes from, in the Trainer's own formats: `pytorch_model.bin`,
`optimizer.pt`, `scheduler.pt`, `trainer_state.json` and `rng_state[_R].pth`, each as the
Trainer's `_save_checkpoint` would have written it (the model's weights saved with torch.save,
so tied weights stay tied, which safetensors refuses).

The trainer state's `log_history` is kept to its last MAX_LOG_HISTORY entries in a snapshot
(a job logging every step would otherwise encode all of it every step); the Trainer's disk
checkpoints keep all of it. This module never changes the Trainer, its model or optimizer, and
reads nothing but what it is given.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

MAX_LOG_HISTORY = 1000


def snapshot(
    state: Any, model: Any, optimizer: Any, scheduler: Any, rank: int, world_size: int
) -> dict[str, Any]:
    """This rank's part of the Trainer's checkpoint at `state.global_step`."""
    python = random.getstate()
    rng: dict[str, Any] = {
        "python": {
            "version": python[0],
            "state": torch.tensor(python[1], dtype=torch.int64),
            "gauss": python[2],
        },
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = (
            torch.cuda.random.get_rng_state_all()
            if world_size > 1
            else torch.cuda.random.get_rng_state()
        )
    part: dict[str, Any] = {"rng": rng, "world_size": world_size}
    if rank == 0:
        part["model"] = model.state_dict()
        part["optimizer"] = optimizer.state_dict()
        if scheduler is not None:
            part["scheduler"] = scheduler.state_dict()
        part["trainer_state"] = trainer_state_json(state)
    return part


def trainer_state_json(state: Any) -> str:
    """`TrainerState.save_to_json`'s text, its log history cut to MAX_LOG_HISTORY entries."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    history = fields.get("log_history")
    if isinstance(history, list) and len(history) > MAX_LOG_HISTORY:
        fields["log_history"] = history[-MAX_LOG_HISTORY:]
    return json.dumps(fields, indent=2, sort_keys=True, default=str) + "\n"


def write_state(folder: Path, zero: dict[str, Any]) -> None:
    """Write the model, optimizer, scheduler and trainer state of rank 0's part `zero`."""
    _save(zero["model"], folder / "pytorch_model.bin")
    _save(zero["optimizer"], folder / "optimizer.pt")
    if "scheduler" in zero:
        _save(zero["scheduler"], folder / "scheduler.pt")
    (folder / "trainer_state.json").write_text(zero["trainer_state"])


def write_rng(folder: Path, own: dict[str, Any], rank: int) -> None:
    """Write rank `rank`'s RNG states from its own part `own`, named as the Trainer names them."""
    rng = dict(own["rng"])
    python = rng["python"]
    rng["python"] = (
        int(python["version"]),
        tuple(int(v) for v in python["state"].tolist()),
        python["gauss"],
    )
    rng["numpy"] = tuple(rng["numpy"])
    world_size = own.get("world_size", 1)
    name = f"rng_state_{rank}.pth" if world_size > 1 else "rng_state.pth"
    _save(rng, folder / name)


def _save(value: Any, path: Path) -> None:
    """torch.save of `value` with its tensors compacted: a loaded snapshot's tensors view one
    region each, which torch.save would write whole, once per file (and `set_rng_state` reads
    a state tensor's storage from its start)."""
    torch.save(_compact(value), path)


def _compact(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return type(value)((k, _compact(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_compact(v) for v in value)
    return value
