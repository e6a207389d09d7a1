"""The tiers a worker loads checkpoints from, in the order `Engine.load` tries them.

A new tier is one file (a `LoadTier` subclass, see base.py) and one line in `REGISTERED`.
"""

from __future__ import annotations

from transom.checkpoint.tiers.base import LoaderContext, LoadTier
from transom.checkpoint.tiers.memory import MemoryTier
from transom.checkpoint.tiers.peer import PeerTier
from transom.checkpoint.tiers.storage import StorageTier

REGISTERED: list[LoadTier] = [
    MemoryTier(),
    PeerTier(),
    StorageTier(),
]

__all__ = ["REGISTERED", "LoadTier", "LoaderContext", "MemoryTier", "PeerTier", "StorageTier"]
