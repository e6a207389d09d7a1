"""The storage tier for the loader: shard files in the storage directory (checkpoint/storage.py).

A shard is found where the server says, else in the worker's own storage directory (so a worker
whose server is gone still finds it); complete steps are those with a manifest.
"""

from __future__ import annotations

from pathlib import Path

from transom.checkpoint import storage
from transom.checkpoint.tiers.base import LoaderContext, LoadTier
from transom.common.states import Tier


class StorageTier(LoadTier):
    name = Tier.STORAGE

    def locate(self, ctx: LoaderContext, step: int, rank: int) -> list[dict]:
        sources = self.from_server(ctx)
        path = storage.shard_path(ctx.storage_dir, step, rank)
        if not sources and path.exists():
            sources.append({"tier": self.name, "path": str(path)})
        return sources

    def read(
        self, ctx: LoaderContext, source: dict, step: int, rank: int
    ) -> tuple[dict, memoryview]:
        return storage.read_shard(Path(source["path"]), step, rank)

    def steps(self, ctx: LoaderContext, world_size: int) -> list[int]:
        return storage.restorable_steps(ctx.storage_dir, world_size)
