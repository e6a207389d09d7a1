"""The peer tier: a replica in another node's checkpoint server, fetched over TCP.

The node's server locates replicas (its fixed peer, and the catalog's memory holders on other
nodes); `replication.fetch` authenticates with the job's secret and verifies the checksums.
"""

from __future__ import annotations

from transom.checkpoint import replication
from transom.checkpoint.tiers.base import LoaderContext, LoadTier
from transom.common.states import Tier


class PeerTier(LoadTier):
    name = Tier.PEER

    def locate(self, ctx: LoaderContext, step: int, rank: int) -> list[dict]:
        return self.from_server(ctx)

    def read(
        self, ctx: LoaderContext, source: dict, step: int, rank: int
    ) -> tuple[dict, memoryview]:
        return replication.fetch(source["addr"], ctx.secret, step, rank)
