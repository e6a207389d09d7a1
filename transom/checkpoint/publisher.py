"""A checkpoint server's side of etcd: its lease, the shards it lists, its events, its plan.

With a store, the server registers its peer address and lists each shard its memory holds
(`catalog.py` has the keys) under a lease, so both vanish when the node dies: the node agent's
when the agent runs it (handed over by `adopt`, agent_lease.py: the server renews and revokes
none, and lists everything again under each new one; one replacing a dead server first
withdraws what that one listed), else a lease of its own, which its control thread renews (a
lost one is replaced and everything re-listed). Persisted shards are listed without a lease.
The control thread follows, through etcd watches, the controller's plan (its members for the
ring peer, its restore step never evicted) and the discarded steps. Its events and its
catalog listings and withdrawals go to etcd in batches (store/batch_writer.py: a save's
listing, its replica's, its persisted copy's, the evicted step's withdrawals and their events
are one or two requests, not eight). Memory listings and withdrawals after a generation's first
are lazy: they go with the next batch, or LAZY_S after they were queued (a server taking a
snapshot every step costs etcd a request every LAZY_S, not every second), because only a
recovery reads them: when the plan says RECOVERING, the server sends everything queued at once,
with a `catalog.Flushed` word in the same transaction, and the controller reads the restore
step only after every member's word (or FLUSH_WAIT_S). The ring peer's address is read once,
and again only after a push to it failed. Without a store every method is a no-op but the log
line of an event. This module never touches shard bytes and never decides what the server keeps.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transom.checkpoint import catalog
from transom.checkpoint.budget import Shard
from transom.checkpoint.reshard_steps import reshardable
from transom.common import keys
from transom.common.records import Plan, RecordError
from transom.common.states import JobState, Tier
from transom.store import Store, StoreError
from transom.store.batch_writer import BatchWriter
from transom.store.etcd_client import REFRESHES_PER_TTL
from transom.store.key_follow import KeyFollower

log = logging.getLogger("transom.ckpt.server")

WAKE_S = 0.25  # the control thread's longest sleep: how late it sees `stopping` or discards


@dataclass(frozen=True)
class PlanView:
    """What the checkpoint server reads of the controller's `plan` record."""

    generation: int | None = None
    members: list[str] = field(default_factory=list)
    restore_step: int | None = None
    previous_members: list[str] = field(default_factory=list)
    recovering: bool = False  # the job is between generations: a restore is being planned


def plan_view(value: Any) -> PlanView:
    """The generation, members and restore step of a stored plan value; empty when there is none.

    The one place the checkpoint server interprets the controller's plan, parsed by the plan's
    one definition (`transom.common.records.Plan`); a plan that does not parse is treated as
    absent.
    """
    if value is None:
        return PlanView()
    try:
        plan = Plan.from_dict(value)
    except RecordError:
        return PlanView()
    return PlanView(
        plan.generation,
        list(plan.members),
        plan.restore_step,
        list(plan.previous_members),
        plan.job_state is JobState.RECOVERING,
    )


class Publisher:
    """The etcd side of server `node` (reachable by peers at `addr`, empty when it has no port),
    under a lease of its own of `lease_ttl_s`, or with None under its node agent's (`adopt`)."""

    def __init__(self, store: Store | None, node: str, lease_ttl_s: int | None):
        self.store = store
        self.node = node
        self.lease_ttl_s = lease_ttl_s
        self.addr = ""
        self.lease: Any = None
        self._offered: int | None = None  # the newest lease id the agent handed over
        # Set when this server replaces a dead one of the same agent: what that one listed is
        # withdrawn before the first listing (it lives under the same lease).
        self.withdraw_stale = False
        self.plan = PlanView()
        self.held: Callable[[], list[Shard]] = (
            list  # the shards in memory, to re-list on a new lease
        )
        self.on_plan: Callable[[PlanView], None] = lambda plan: None
        # Poisoned steps (catalog.discards): applied by `on_discard`, never listed again.
        self.discards: list[catalog.Discard] = []
        self.on_discard: Callable[[list[catalog.Discard]], None] = lambda marks: None
        # The plan and the discards as etcd pushes them (followed by `follow`).
        self.plans = KeyFollower(store, keys.PLAN) if store is not None else None
        self.marks = KeyFollower(store, keys.CKPT_DISCARDED) if store is not None else None
        # Events and catalog entries go to etcd in batches from a thread of their own (a save's
        # several events and listings, one request): the threads that move shards never wait
        # for etcd.
        self.writes = (
            BatchWriter(store, f"etcd-writes-{node}", live_lease=lambda: self.lease)
            if store is not None
            else None
        )
        self._peer_addrs: dict[str, str] = {}  # peer node -> the address it registered
        self._listed_generation = -1  # the newest generation whose shard was listed

    def start(self, addr: str) -> None:
        """Take a lease and register `addr`; no-op without a store."""
        self.addr = addr
        if self.store is not None and self.plans is not None and self.marks is not None:
            self.store.wait_healthy(10.0)
            try:  # the followers' first reads (`follow` starts any that failed here)
                self.marks.start(time.monotonic())
                self.plans.start(time.monotonic())
                self.plan = plan_view(self.plans.value)
                self.discards = catalog.parse_discards(self.marks.value)
                self.on_plan(self.plan)
            except StoreError as e:
                log.warning("cannot read the plan yet: %s", e)
            if self.lease_ttl_s is not None:
                self._relist(self.store.lease(self.lease_ttl_s))

    def stale_generation(self, generation: int) -> str | None:
        """Why a write from `generation` is refused (older than the plan's), None when it is not."""
        current = self.plan.generation
        if current is not None and generation < current:
            return (
                f"generation {generation} is older than the plan's generation {current}: "
                "a write of a replaced generation is refused"
            )
        return None

    def stop(self) -> None:
        """Withdraw the registration and the memory listings (by revoking the lease, or in the
        last batch when the lease is the agent's, which lives on)."""
        if self.writes is not None and self.lease is not None and self.lease_ttl_s is None:
            self.writes.delete(keys.ckpt_server(self.node))
            for shard in self.held():
                self.unlist_memory(shard)
        if self.writes is not None:
            self.writes.close()
        if self.store is not None and self.lease is not None and self.lease_ttl_s is not None:
            try:
                self.store.revoke(self.lease)
            except StoreError:
                pass

    def adopt(self, lease_id: int) -> None:
        """Take the node agent's lease `lease_id` (any thread): the control thread lists
        everything under it within WAKE_S."""
        self._offered = lease_id

    def _take_offered(self) -> None:
        """List under the lease the agent handed over last, if it is new (StoreError: on the
        next tick again)."""
        offered = self._offered
        if offered is None or (self.lease is not None and self.lease.id == offered):
            return
        assert self.store is not None
        if self.withdraw_stale:
            withdrawn = catalog.withdraw_memory(self.store, self.node)
            self.withdraw_stale = False
            log.info("withdrew %d memory listings of the dead server this one replaces", withdrawn)
        self._relist(self.store.lease_of(offered))

    def _relist(self, lease: Any) -> None:
        """Register and list what memory holds under `lease` (StoreError: not registered)."""
        assert self.store is not None
        if self.addr:
            catalog.register_server(self.store, self.node, self.addr, lease)
        self.lease = lease
        for shard in self.held():
            self.list_memory(shard)
        if self.writes is not None:
            self.writes.hurry()  # what the lost lease took with it

    def follow(self, stopping: threading.Event) -> None:
        """Keep the lease (or take the agent's newest) and follow the plan and the discards until
        `stopping` is set (a thread's body). Both keys are pushed by etcd watches (they change a
        few times a job); a lease of its own is the one steady request, renewed
        `REFRESHES_PER_TTL` times a TTL (as the node agent's: every 4 s for the default 8 s
        lease, every 10 s for a large job's 20 s); under the agent's there is none."""
        plans, marks = self.plans, self.marks
        if self.store is None or plans is None or marks is None:
            return
        ttl_s = self.lease_ttl_s  # None: the agent's lease
        period = math.inf if ttl_s is None else ttl_s / REFRESHES_PER_TTL
        refresh_at = time.monotonic() + period
        taken = (-1, -1)  # the (discards, plan) revisions last taken in
        try:
            while not stopping.is_set():
                now = time.monotonic()
                try:
                    marks.start_once(now)
                    plans.start_once(now)
                    marks.refresh(now)
                    plans.refresh(now)
                    if (marks.revision, plans.revision) != taken:
                        taken = (marks.revision, plans.revision)
                        # Discards first: the controller writes them before the plan that
                        # follows, and before a new lease re-lists what memory holds.
                        discards = catalog.parse_discards(marks.value)
                        if discards != self.discards:
                            self.discards = discards
                            self.on_discard(discards)
                        plan = plan_view(plans.value)
                        if plan.generation != self.plan.generation and self.writes is not None:
                            # A new generation's workers look up the catalog as they start:
                            # the listings that wait for the spacing go now.
                            self.writes.hurry()
                        if plan.recovering and plan.generation is not None:
                            self._flush_for(plan.generation)
                        self.plan = plan
                        self.on_plan(self.plan)
                    if ttl_s is None:
                        self._take_offered()
                    elif now >= refresh_at:
                        refresh_at = now + period
                        if not self.store.refresh(self.lease):
                            self._relist(self.store.lease(ttl_s))
                except StoreError as e:
                    log.debug("control tick: %s", e)
                    stopping.wait(WAKE_S)
                plans.wait(max(0.0, min(refresh_at - time.monotonic(), WAKE_S)))
        finally:
            plans.stop()
            marks.stop()

    def _flush_for(self, generation: int) -> None:
        """A recovery began: send what memory holds now, with word of it (`catalog.Flushed`, in
        the same transaction) that the controller waits for before it plans the restore step
        (the memory listings of snapshots otherwise wait up to LAZY_S)."""
        if self.writes is None or self.lease is None:
            return
        ack = catalog.Flushed(generation).to_dict()
        self.writes.put(keys.ckpt_flushed(self.node), ack, lease=self.lease)
        self.writes.flush()

    def peer_addr(self, peer: str, fresh: bool = False) -> str | None:
        """The address `peer`'s server registered (None without a store or a registration): as
        read the last time unless `fresh` (after a push to it failed: its server may have been
        restarted elsewhere), so a replica costs etcd no request."""
        if self.store is None:
            return None
        if fresh or peer not in self._peer_addrs:
            addr = catalog.server_addr(self.store, peer)
            if addr is None:
                self._peer_addrs.pop(peer, None)
                return None
            self._peer_addrs[peer] = addr
        return self._peer_addrs[peer]

    # -- the catalog ---------------------------------------------------------------------------
    def discarded(self, shard: Shard) -> bool:
        """Whether `shard` falls under a discard this server knows of (catalog.discards)."""
        return catalog.is_discarded(self.discards, shard.step, shard.generation)

    def list_memory(self, shard: Shard) -> None:
        """List a shard this server's memory holds (under the lease); never a discarded one, nor
        any before the agent handed its lease over (all are listed then)."""
        if self.lease is None:
            return
        self._list(
            shard,
            catalog.memory_holder(self.node),
            Tier.MEMORY,
            self.lease,
            addr=self.addr,
            origin=shard.origin,
        )

    def _list(
        self,
        shard: Shard,
        holder: str,
        tier: Tier,
        lease: Any = None,
        addr: str = "",
        origin: str = "",
        path: str = "",
    ) -> None:
        """Queue `shard`'s catalog entry as held by `holder` in `tier` (`addr`, `origin`, `path`:
        the tier's own fields of a `catalog.Listing`), unless it is discarded (and withdraw it
        if a discard came meanwhile)."""
        if self.writes is None or self.discarded(shard):
            return
        listing = catalog.Listing(
            shard.step,
            shard.rank,
            tier,
            world_size=shard.world_size,
            node=self.node,
            nbytes=shard.region.nbytes,
            generation=shard.generation,
            reshardable=reshardable(shard.header),
            addr=addr,
            origin=origin,
            path=path,
        )
        name, value = catalog.entry(holder, listing)
        # A generation's first listing goes at once (the batch writer's spacing would hold it up
        # to SPACING_S): a restart soon after it looks for it. The other memory listings are
        # lazy: a recovery is what reads them, and it flushes them first (`_flush_for`).
        urgent = shard.generation > self._listed_generation
        self._listed_generation = max(self._listed_generation, shard.generation)
        lazy = tier is Tier.MEMORY
        self.writes.put(name, value, lease=lease, urgent=urgent, lazy=lazy)
        self._unless_discarded(shard, name)

    def _unless_discarded(self, shard: Shard, name: str) -> None:
        """Withdraw an entry just listed if a discard came meanwhile: the sweeps of that discard
        (the controller's, this server's on learning of it) may have run before the entry was
        there. (A discard learnt after this look sweeps the entry itself; one that comes while
        the listing waits in the batch makes it count for nothing: catalog.restorable_steps.)"""
        if self.writes is not None and self.discarded(shard):
            self.writes.delete(name)

    def unlist_memory(self, shard: Shard) -> None:
        """Withdraw an evicted shard, in the background (called with the memory lock held)."""
        if self.writes is not None:
            key = catalog.shard_key(shard.step, shard.rank, catalog.memory_holder(self.node))
            self.writes.delete(key, lazy=True)

    def withdraw(self, step: int, rank: int, holder: str) -> None:
        """Withdraw one listing now, not batched (a copy found corrupt: the next plan must not
        restore from it); a failure is logged (the listing then stays until its lease ends)."""
        if self.store is None:
            return
        try:
            self.store.delete(catalog.shard_key(step, rank, holder))
        except StoreError as e:
            log.warning("cannot withdraw step %d rank %d of %s: %s", step, rank, holder, e)

    def list_storage(self, shard: Shard, path: str, removed: dict[int, list[int]]) -> None:
        """List a persisted shard (no lease: it outlives the node), never a discarded one; forget
        the shards of the steps retention removed (step -> ranks), in the same batch."""
        if self.writes is None:
            return
        self._list(shard, catalog.STORAGE_HOLDER, Tier.STORAGE, path=path)
        for step, ranks in removed.items():
            for rank in ranks:
                self.writes.delete(catalog.shard_key(step, rank, catalog.STORAGE_HOLDER))

    def memory_copies(self, step: int, rank: int) -> list[catalog.MemoryCopy]:
        """The servers whose memory holds shard (step, rank), per the catalog ([] without a
        store or on error)."""
        if self.store is None:
            return []
        try:
            return catalog.memory_copies(catalog.holders(self.store, step, rank))
        except StoreError as e:
            log.warning("cannot read the catalog: %s", e)
            return []

    def restorable_steps(self, world_size: int) -> list[int] | None:
        """Restorable steps per the catalog; None without a store or when etcd cannot answer."""
        if self.store is None:
            return None
        try:
            return catalog.restorable_steps(self.store, world_size)
        except StoreError as e:
            log.warning("cannot read the catalog, using local tiers only: %s", e)
            return None

    # -- events --------------------------------------------------------------------------------
    def event(self, action: str, message: str, **fields: Any) -> None:
        """A `checkpoint` event: into etcd's event log when there is one, and into the log."""
        log.info("%s", message)
        if self.writes is None:
            return
        now = time.time()
        value = {
            "time": now,
            "kind": "checkpoint",
            "action": action,
            "message": message,
            "node": self.node,
            **fields,
        }
        source = f"ckpt-{self.node}-{threading.get_ident() % 10000}"
        self.writes.put(keys.event(now, source), value)
