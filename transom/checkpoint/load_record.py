"""What a checkpoint load read: `Engine.last_load`'s record (`LoadRecord`, with `Resharded`).

The engine sets it when a load succeeds (engine.py); a resharding load adds what it did
(reshard.py); training scripts and tests read it. It never leaves the worker's process, so it has
no JSON form. This module must never do I/O or import torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resharded:
    """A load that rebuilt this rank's state from a world of another size's shards."""

    from_world_size: int
    source_rank: int  # the saved rank whose shard gave the replicated state
    dropped: tuple[str, ...] = ()  # per-rank values left out (they were another rank's)


@dataclass(frozen=True)
class LoadRecord:
    """The last load: its step, the tier it came from (a `Tier`'s or a registered tier's name),
    how long it took, and, when it was resharded, how."""

    step: int
    tier: str
    seconds: float
    resharded: Resharded | None = None
