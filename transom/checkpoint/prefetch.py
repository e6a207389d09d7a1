"""Restore prefetch: a server pulls its ranks' shards of the plan's restore step from peers.

When the controller's plan names a restore step, each server works out its node's ranks (the
node at position i of the plan's members runs ranks i*N .. i*N+N-1, N = `ranks_per_node`) and,
for every one of them its memory does not hold, fetches the shard at once from a peer whose
memory the catalog lists as holding it, straight into a region of its own memory (the fetch
verifies the checksums). A replacement node's workers then load from local memory instead of
each fetching over the network when they get there. It starts when the server first reads the
plan (pushed by a watch, publisher.py) or, if a worker asks first, when that worker
`locate`s the shard: either way one transfer per shard, never one from the server and one from
the worker.

The rules it keeps:
  * a prefetched shard is a replica of the node it came from (its origin): it counts against
    the budget and is reserved like any other (`ShardMemory.reserve`); one that does not fit is
    skipped (logged and reported as a `prefetch-skipped` event), never an error;
  * it is the plan's restore step, so it is kept like one (never evicted while the plan names
    it); a step discarded as poisoned is never taken in;
  * one attempt per shard per plan: a failed or skipped prefetch is not retried until the plan
    changes, so it never holds a worker up twice;
  * a worker whose shard is being fetched waits for it at most PREFETCH_WAIT_S (well inside its
    own `locate` limit, engine.LOCATE_TIMEOUT_S), then takes the other sources as before (a
    peer, storage): a prefetch can delay a load by at most that bound, and only when the
    transfer it would have made itself is stalled too.
This module never decides what a server keeps beyond that and never serves a worker's request.
"""

from __future__ import annotations

import logging
import threading
import time

from transom.checkpoint import catalog, replication, shard_format
from transom.checkpoint.budget import BudgetExceeded, ShardMemory
from transom.checkpoint.pipeline import SavePipeline
from transom.checkpoint.publisher import PlanView, Publisher
from transom.checkpoint.shard_format import ShardHeader
from transom.checkpoint.shm import Region
from transom.checkpoint.worker_protocol import PrefetchStatus
from transom.common.names import check_id
from transom.common.states import Tier

log = logging.getLogger("transom.ckpt.server")

# A worker's `locate` waits this long at most for a prefetch of its shard that is under way.
PREFETCH_WAIT_S = 30.0

FETCHED = "fetched"
SKIPPED = "skipped"
FAILED = "failed"
NOWHERE = "no other node's memory holds it"


class Prefetcher:
    """Fetches this node's ranks' shards of the plan's restore step into `memory` (see above)."""

    def __init__(
        self,
        node: str,
        ranks_per_node: int,
        secret: bytes,
        memory: ShardMemory,
        pipeline: SavePipeline,
        publisher: Publisher,
    ):
        self.node = node
        self.ranks_per_node = ranks_per_node
        self.secret = secret
        self.memory = memory
        self.lock = memory.lock
        self.pipeline = pipeline
        self.publisher = publisher
        self.in_flight: set[tuple[int, int]] = set()  # guarded by `lock`
        self.attempted: set[tuple[int, int]] = set()  # this plan's, guarded by `lock`
        # (step, rank) -> what became of its prefetch: {"outcome", "detail", "seconds"}.
        self.outcomes: dict[tuple[int, int], PrefetchStatus] = {}
        self._plan_key: tuple[int | None, int | None, tuple[str, ...]] | None = None

    def ranks(self, plan: PlanView) -> list[int]:
        """This node's ranks in the world of `plan` ([] when it is not a member)."""
        if self.ranks_per_node < 1 or self.node not in plan.members:
            return []
        first = plan.members.index(self.node) * self.ranks_per_node
        return list(range(first, first + self.ranks_per_node))

    def follow(self, plan: PlanView) -> None:
        """The plan as the server read it: a new plan with a restore step starts the prefetch of
        this node's ranks' shards of it (called on every read; a no-op for a plan seen before)."""
        key = (plan.generation, plan.restore_step, tuple(plan.members))
        if key == self._plan_key:
            return
        first, self._plan_key = self._plan_key is None, key
        if first:  # the plan this server found at its start: its workers loaded already, or
            return  # will ask (`join`); a restarted server must not hold a stale step again
        with self.lock:
            self.attempted.clear()
        if plan.restore_step is None or self.publisher.store is None:
            return
        for rank in self.ranks(plan):
            self._start(plan.restore_step, rank)

    def join(self, step: int, rank: int) -> None:
        """Before a worker's `locate` of (step, rank): start the prefetch if it is one of this
        node's shards of the plan's restore step and nobody started it yet, then wait for a
        prefetch of it under way, at most PREFETCH_WAIT_S."""
        plan = self.publisher.plan
        if step == plan.restore_step and rank in self.ranks(plan):
            self._start(step, rank)
        with self.lock:
            if (step, rank) in self.in_flight:
                self.lock.wait_for(lambda: (step, rank) not in self.in_flight, PREFETCH_WAIT_S)

    def _start(self, step: int, rank: int) -> None:
        key = (step, rank)
        with self.lock:
            if key in self.in_flight or key in self.attempted or key in self.memory.shards:
                return
            self.in_flight.add(key)
            self.attempted.add(key)
        try:
            threading.Thread(
                target=self._run, args=(step, rank), name="ckpt-prefetch", daemon=True
            ).start()
        except RuntimeError as e:  # no thread to be had: the workers take the usual path
            self._finish(PrefetchStatus(step, rank, FAILED, f"no thread: {e}"))

    def _finish(self, outcome: PrefetchStatus) -> None:
        key = (outcome.step, outcome.rank)
        with self.lock:
            self.outcomes[key] = outcome
            self.in_flight.discard(key)
            self.lock.notify_all()

    def _run(self, step: int, rank: int) -> None:
        t0 = time.monotonic()
        try:
            outcome, detail = self._fetch(step, rank)
        except Exception as e:  # noqa: BLE001 - a prefetch must never take the server down
            outcome, detail = FAILED, f"{type(e).__name__}: {e}"
        took = time.monotonic() - t0
        self._finish(PrefetchStatus(step, rank, outcome, detail, took))
        if outcome == FETCHED:
            self.publisher.event(
                "prefetched",
                f"step {step} rank {rank} fetched from {detail} into {self.node}'s memory "
                f"ahead of its workers in {took:.3f} s",
                step=step,
                rank=rank,
                tier=Tier.MEMORY,
                peer=detail,
                duration_s=took,
            )
        elif detail == NOWHERE:  # e.g. a rank the saving world did not have: nothing to say
            log.info("step %d rank %d not prefetched: %s", step, rank, detail)
        else:
            self.publisher.event(
                "prefetch-skipped",
                f"step {step} rank {rank} not prefetched into {self.node}'s memory ({outcome}: "
                f"{detail}); its worker loads from a peer or storage",
                step=step,
                rank=rank,
                reason=detail,
            )

    def _sources(self, step: int, rank: int) -> list[catalog.MemoryCopy]:
        """Other nodes' memory holding (step, rank), per the catalog."""
        return [c for c in self.publisher.memory_copies(step, rank) if c.node != self.node]

    def _fetch(self, step: int, rank: int) -> tuple[str, str]:
        """(outcome, the peer it came from or why not) of one prefetch."""
        sources = self._sources(step, rank)
        if not sources:
            return SKIPPED, NOWHERE
        errors = []
        for copy in sources:
            try:
                origin = check_id("origin", copy.node)
            except ValueError as e:
                errors.append(str(e))
                continue
            taken: list[Region] = []

            def into_region(
                header: ShardHeader, origin: str = origin, taken: list[Region] = taken
            ) -> memoryview:
                region = self.memory.reserve(
                    step, rank, header.data_len, header.world_size, origin=origin
                )
                taken.append(region)
                return region.view()[: header.data_len]

            try:
                header, header_bytes = replication.fetch_into(
                    copy.addr, self.secret, step, rank, into_region
                )
            except BudgetExceeded as e:  # does not fit (or a worker saves it now): skip
                return SKIPPED, str(e)
            except (replication.ReplicationError, shard_format.ShardError) as e:
                if taken:
                    self.memory.abort(step, rank, taken[0])
                errors.append(str(e))
                continue
            except BaseException:
                if taken:
                    self.memory.abort(step, rank, taken[0])
                raise
            return self._keep(step, rank, taken[0], header, header_bytes, origin)
        return FAILED, "; ".join(errors)

    def _keep(
        self,
        step: int,
        rank: int,
        region: Region,
        header: ShardHeader,
        header_bytes: bytes,
        origin: str,
    ) -> tuple[str, str]:
        """Make a fetched shard a complete one of this server's memory (listed in the catalog),
        unless it falls under a discard."""
        with self.lock:
            shard = self.memory.shards.get((step, rank))
            if shard is None or shard.region is not region:
                return FAILED, "its region was taken back during the transfer"
            shard.header, shard.world_size = header, header.world_size
            shard.header_bytes = header_bytes
            shard.staged_at = time.time()
        if not self.pipeline.committed(shard):  # evicted there: discarded, or superseded
            return SKIPPED, "the step was discarded, or is older than the steps memory keeps"
        return FETCHED, origin

    def status(self) -> list[PrefetchStatus]:
        """What became of every prefetch (the `status` request shows it)."""
        with self.lock:
            done = list(self.outcomes.values())
            running = [PrefetchStatus(s, r, "running") for s, r in self.in_flight]
        return done + running
