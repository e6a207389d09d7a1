"""Where a worker loads checkpoints from: the tiers, in the order `Engine.load` tries them.

`first_good` walks `REGISTERED` in order for `Engine.load` (fastest first: local memory, a
peer's memory, storage), tries every copy each tier locates, and takes the first whose checksums
verify; a bad or unreachable copy is reported and the next one tried. A new tier (e.g. an
object store) is a `LoadTier` subclass plus one line in `REGISTERED`.

A tier's `read` must verify what it returns (the shard format's checksums, `shard_format`) and
raise `ShardError` for a bad copy or `OSError` (`ConnectionError` included) for one it cannot
reach:
  memory   a shard in this node's checkpoint server, mapped copy-on-write: no copy, the worker
           maps the server's region privately (the server never writes into a region it handed
           out for loading again, shm.py) and verifies the checksums in place; never written to
  peer     a replica in another node's checkpoint server, fetched over TCP: the node's server
           locates replicas (its fixed peer, and the catalog's memory holders on other nodes);
           `replication.fetch` authenticates with the job's secret and verifies the checksums
  storage  shard files in the storage directory (checkpoint/storage.py), found where the server
           says, else in the worker's own storage directory (so a worker whose server is gone
           still finds it); complete steps are those with a manifest
This module must never import torch at run time; only a tier's `read` talks to another process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from transom.checkpoint import replication, shard_format, storage
from transom.checkpoint.bad_copy import BadCopy
from transom.checkpoint.client import CheckpointError
from transom.checkpoint.shard_format import ShardHeader
from transom.checkpoint.shm import anonymous_buffer, populated_map
from transom.checkpoint.worker_protocol import Source
from transom.common.states import Tier

T = TypeVar("T")


@dataclass(frozen=True)
class LoaderContext:
    """What a loading worker knows: its storage directory, the job's secret, and for one shard
    the copies its node's server located (`locate` request; empty when unreachable)."""

    storage_dir: Path
    secret: bytes
    located: list[Source] = field(default_factory=list)


class LoadTier(ABC):
    """One place shards can be loaded from. `name` is what events and `Engine.last_load` say."""

    name: str

    @abstractmethod
    def locate(self, ctx: LoaderContext, step: int, rank: int) -> list[Source]:
        """This tier's copies of shard (step, rank), fastest first, as sources whose `tier` is
        `name` (the rest is the tier's own: a path, an address, a header)."""

    @abstractmethod
    def read(
        self, ctx: LoaderContext, source: Source, step: int, rank: int
    ) -> tuple[ShardHeader, memoryview]:
        """(header, data) of a copy `locate` returned, checksums verified: the data a view of
        exactly the shard's data bytes, which `layout.rebuild` turns into tensors, no copy."""

    def steps(self, ctx: LoaderContext, world_size: int) -> list[int]:
        """Steps this tier holds for every rank of `world_size`, as far as the loader can tell
        without the node's server (asked only when the server cannot answer); [] by default."""
        return []

    def from_server(self, ctx: LoaderContext) -> list[Source]:
        """The copies the server located in this tier."""
        return [s for s in ctx.located if s.tier == self.name]


class MemoryTier(LoadTier):
    """The local memory tier: a shard in this node's checkpoint server, mapped copy-on-write."""

    name = Tier.MEMORY

    def locate(self, ctx: LoaderContext, step: int, rank: int) -> list[Source]:
        return self.from_server(ctx)

    def read(
        self, ctx: LoaderContext, source: Source, step: int, rank: int
    ) -> tuple[ShardHeader, memoryview]:
        header, path = source.header, source.path
        if header is None or path is None:
            raise shard_format.ShardError("the server located a memory copy without its header")
        shard_format.check_identity(header, step, rank)
        n = header.data_len
        if n == 0:
            empty = memoryview(anonymous_buffer(0))[:0]
            shard_format.verify_data(header, empty)
            return header, empty
        view = memoryview(populated_map(Path(path), n, private=True))
        shard_format.verify_data(header, view)
        return header, view


class PeerTier(LoadTier):
    """The peer tier: a replica in another node's checkpoint server, fetched over TCP."""

    name = Tier.PEER

    def locate(self, ctx: LoaderContext, step: int, rank: int) -> list[Source]:
        return self.from_server(ctx)

    def read(
        self, ctx: LoaderContext, source: Source, step: int, rank: int
    ) -> tuple[ShardHeader, memoryview]:
        if source.addr is None:
            raise replication.ReplicationError("the server located a peer copy without its address")
        return replication.fetch(source.addr, ctx.secret, step, rank)


class StorageTier(LoadTier):
    """The storage tier: shard files in the storage directory."""

    name = Tier.STORAGE

    def locate(self, ctx: LoaderContext, step: int, rank: int) -> list[Source]:
        sources = self.from_server(ctx)
        path = storage.shard_path(ctx.storage_dir, step, rank)
        if not sources and path.exists():
            sources.append(Source(self.name, path=str(path)))
        return sources

    def read(
        self, ctx: LoaderContext, source: Source, step: int, rank: int
    ) -> tuple[ShardHeader, memoryview]:
        if source.path is None:
            raise shard_format.ShardError("the server located a stored copy without its path")
        return storage.read_shard(Path(source.path), step, rank)

    def steps(self, ctx: LoaderContext, world_size: int) -> list[int]:
        return storage.restorable_steps(ctx.storage_dir, world_size)


REGISTERED: list[LoadTier] = [
    MemoryTier(),
    PeerTier(),
    StorageTier(),
]

__all__ = ["REGISTERED", "LoadTier", "LoaderContext", "MemoryTier", "PeerTier", "StorageTier"]


def first_good(
    ctx: LoaderContext,
    step: int,
    rank: int,
    only: str | None,
    build: Callable[[ShardHeader, memoryview], T],
    bad: Callable[[BadCopy], None],
) -> tuple[str, ShardHeader, T]:
    """Walk REGISTERED (fastest first; `only`: the tier of that name alone) and every copy each
    locates of rank `rank`'s shard of `step`, until one verifies and `build` takes it: (the
    tier's name, the header, what `build` made of it). Each copy that fails is handed to `bad`
    first; CheckpointError naming each when none is good."""
    problems = []
    for tier in REGISTERED:
        if only is not None and tier.name != only:
            continue
        for source in tier.locate(ctx, step, rank):
            name = str(tier.name)
            try:
                header, data = tier.read(ctx, source, step, rank)
                return name, header, build(header, data)
            except (shard_format.ShardError, replication.ReplicationError, OSError) as e:
                problems.append(f"{name}: {e}")
                corrupt = isinstance(e, shard_format.ShardError)  # not just unreachable
                bad(BadCopy(step, rank, name, str(e), source.node, corrupt))
    raise CheckpointError(
        f"step {step} rank {rank}: no good copy in any tier "
        f"({'; '.join(problems) or 'no tier holds it'})"
    )
