"""The loader's view of a checkpoint tier: find a shard's copies, read one, list what it holds.

`Engine.load` walks `tiers.REGISTERED` in order (fastest first: local memory, a peer's memory,
storage), tries every copy each tier locates, and takes the first whose checksums verify; a bad
or unreachable copy is reported and the next one tried. A new tier (e.g. an object store) is a
`LoadTier` subclass in its own file plus one line in `tiers/__init__.py`'s list.

A tier's `read` must verify what it returns (the shard format's checksums, `shard_format`) and
raise `ShardError` for a bad copy or `OSError` (`ConnectionError` included) for one it cannot
reach. This module must never import torch at run time or talk to a server.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class LoaderContext:
    """What a loading worker knows: its storage directory, the job's secret, and for one shard
    the copies its node's server located (`locate` request; empty when unreachable)."""

    storage_dir: Path
    secret: bytes
    located: list[dict] = field(default_factory=list)


class LoadTier(ABC):
    """One place shards can be loaded from. `name` is what events and `Engine.last_load` say."""

    name: str

    @abstractmethod
    def locate(self, ctx: LoaderContext, step: int, rank: int) -> list[dict]:
        """This tier's copies of shard (step, rank), fastest first, as JSON-able sources whose
        "tier" is `name` (the rest is the tier's own: a path, an address, a header)."""

    @abstractmethod
    def read(
        self, ctx: LoaderContext, source: dict, step: int, rank: int
    ) -> tuple[dict, memoryview]:
        """(header, data) of a copy `locate` returned, checksums verified: the data a view of
        exactly the shard's data bytes, which `layout.rebuild` turns into tensors, no copy."""

    def steps(self, ctx: LoaderContext, world_size: int) -> list[int]:
        """Steps this tier holds for every rank of `world_size`, as far as the loader can tell
        without the node's server (asked only when the server cannot answer); [] by default."""
        return []

    def from_server(self, ctx: LoaderContext) -> list[dict]:
        """The copies the server located in this tier."""
        return [s for s in ctx.located if s.get("tier") == self.name]
