"""The local memory tier: a shard in this node's checkpoint server, mapped copy-on-write.

No copy: the worker maps the server's region privately (the server never writes into a region
it handed out for loading again, shm.py) and verifies the checksums in place. This module never
writes into a region.
"""

from __future__ import annotations

from pathlib import Path

import torch

from transom.checkpoint import layout
from transom.checkpoint.shm import anonymous_buffer, as_bytes, populated_map
from transom.checkpoint.tiers.base import LoaderContext, LoadTier
from transom.common.states import Tier


class MemoryTier(LoadTier):
    name = Tier.MEMORY

    def locate(self, ctx: LoaderContext, step: int, rank: int) -> list[dict]:
        return self.from_server(ctx)

    def read(
        self, ctx: LoaderContext, source: dict, step: int, rank: int
    ) -> tuple[dict, torch.Tensor]:
        header = source["header"]
        layout.check_identity(header, step, rank)
        n = int(header["data_len"])
        if n == 0:
            buf = anonymous_buffer(0)
            layout.verify_data(header, memoryview(buf)[:0])
            return header, as_bytes(buf)[:0]
        m = populated_map(Path(source["path"]), n, private=True)
        view = memoryview(m)
        layout.verify_data(header, view)
        del view
        return header, as_bytes(m)
