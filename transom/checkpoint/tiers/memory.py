"""The local memory tier: a shard in this node's checkpoint server, mapped copy-on-write.

No copy: the worker maps the server's region privately (the server never writes into a region
it handed out for loading again, shm.py) and verifies the checksums in place. This module never
writes into a region.
"""

from __future__ import annotations

from pathlib import Path

from transom.checkpoint import shard_format
from transom.checkpoint.shm import anonymous_buffer, populated_map
from transom.checkpoint.tiers.base import LoaderContext, LoadTier
from transom.common.states import Tier


class MemoryTier(LoadTier):
    name = Tier.MEMORY

    def locate(self, ctx: LoaderContext, step: int, rank: int) -> list[dict]:
        return self.from_server(ctx)

    def read(
        self, ctx: LoaderContext, source: dict, step: int, rank: int
    ) -> tuple[dict, memoryview]:
        header = source["header"]
        shard_format.check_identity(header, step, rank)
        n = int(header["data_len"])
        if n == 0:
            empty = memoryview(anonymous_buffer(0))[:0]
            shard_format.verify_data(header, empty)
            return header, empty
        view = memoryview(populated_map(Path(source["path"]), n, private=True))
        shard_format.verify_data(header, view)
        return header, view
