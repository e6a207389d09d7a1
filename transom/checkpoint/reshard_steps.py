"""Which checkpoint steps a world of W ranks can restore, resharding included (no torch here).

A step is restorable for W when every rank 0..W-1 holds a shard saved by a world of W, or when
every rank 0..W'-1 of the world W' that saved it holds a shard whose header carries a resharding
record (reshard.py writes and reads those records). The catalog (catalog.py, etcd) and a server
without etcd (its memory and storage) both answer with `restorable`. This module must never
import torch or touch shard bytes: node agents and the controller import it through the catalog.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from transom.checkpoint.shard_header import ShardHeader


def reshardable(header: ShardHeader | None) -> bool:
    """Whether a shard's header carries a resharding record."""
    return header is not None and header.reshard is not None


def restorable(entries: Iterable[tuple[int, int, Any, bool]], world_size: int) -> set[int]:
    """Steps restorable for a world of `world_size`, from (step, rank, saved world size,
    reshardable) of every shard a live tier holds: complete for this world, or complete for the
    world that saved it with every shard reshardable."""
    same: dict[int, set[int]] = {}
    other: dict[tuple[int, int], set[int]] = {}
    for step, rank, saved_world, flag in entries:
        if saved_world == world_size:
            same.setdefault(step, set()).add(rank)
        if flag and type(saved_world) is int and saved_world > 0:
            other.setdefault((step, saved_world), set()).add(rank)
    steps = {s for s, ranks in same.items() if ranks >= set(range(world_size))}
    steps |= {s for (s, w), ranks in other.items() if ranks >= set(range(w))}
    return steps
