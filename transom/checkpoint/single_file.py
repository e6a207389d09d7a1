"""A torch.save / torch.load pair in the shard format: one file, atomic, checksummed, no pickle.

`save(obj, path)` writes what `Engine` would hold for one rank (the shard format) with an
atomic rename; `load(path)` reads it back bit for bit or raises the format's error (ShardError).
This module must never unpickle anything: files cross trust boundaries.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from transom.checkpoint import flatten, layout, shard_format, storage
from transom.checkpoint.shm import anonymous_buffer


def to_device(value: Any, device: str | torch.device) -> Any:
    """`value` with every tensor in it moved to `device` (containers keep their types)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        out = type(value)((k, to_device(v, device)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Like torch.save, in the shard format: atomic, checksummed, loadable without pickle."""
    plan = flatten.plan_state(obj, step=0, rank=0, world_size=1)
    buf = anonymous_buffer(plan.data_len)
    data = layout.as_bytes(buf)[: plan.data_len]
    flatten.copy_into(plan, data)
    if plan.cuda:
        torch.cuda.synchronize()
    view = memoryview(buf)[: plan.data_len]
    plan.header = plan.header.with_chunks(shard_format.checksum_data(view))
    path = Path(path)
    storage.atomic_write(path, [shard_format.encode_header(plan.header), view])


def load(path: str | os.PathLike[str], map_location: str | torch.device | None = None) -> Any:
    """Like torch.load(weights_only=True) for files written by `save`; ShardError when corrupt."""
    header, data = storage.read_shard(Path(path))
    state = layout.rebuild(header, data)
    return to_device(state, map_location) if map_location is not None else state
