"""A checkpoint server's memory: the shards it holds, its region pool, and the budget they share.

Every region (own shards, peers' replicas, spare regions kept for reuse) counts against a budget
in bytes. A rank's newest complete shard, shards being saved or transferred (pinned) and the
plan's restore step are never evicted; beyond those, the oldest go first, and beyond
`memory_keep` steps per rank shards are evicted after each save (their regions kept in the free
pool for the next save of the same size). A spare region can be prepared (populated) ahead of a
rank's next save, only within the budget and only while the rank holds at most `memory_keep`
regions: with a `memory_keep` of 1 a node holds its newest complete step and the region of the
save in progress (2x its share; the default keeps 2 steps: 3x), and each replica it holds counts
against its budget. A worker's `prepare` has the whole rotation of its saves made at once.
A reservation that cannot fit is refused with `BudgetExceeded`, before
anything is evicted.

`lock` (a Condition) guards every shard's state; whoever changes one notifies it. This module
never moves shard bytes, never talks to etcd or a socket, and never blocks a caller on anything
but the region hand-out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from transom.checkpoint import shard_format
from transom.checkpoint.saved_by import saved_by
from transom.checkpoint.shm import Region, RegionDir
from transom.checkpoint.worker_protocol import PrefetchStatus, ShardStatus, Status
from transom.common.states import Tier

# A reservation waits this long at most for a spare region being populated right now.
PREPARING_WAIT_S = 5.0

# A shard's states: reserved (a writer is copying into it) -> staged (the writer committed its
# header; checksums are being computed) -> committed (complete, in the memory tier).
RESERVED = "reserved"
STAGED = "staged"
COMMITTED = "committed"
LOCAL = "local"  # the origin of a shard this node's workers saved


class BudgetExceeded(RuntimeError):
    """A save does not fit in the server's memory budget."""


@dataclass
class Shard:
    step: int
    rank: int
    world_size: int
    region: Region
    origin: str  # LOCAL, or the node a replica came from
    state: str = RESERVED
    header: shard_format.ShardHeader | None = None
    header_bytes: bytes = b""
    tiers: set[Tier] = field(default_factory=set)
    failed: dict[Tier, str] = field(default_factory=dict)
    pins: int = 0  # transfers reading the region right now
    staged_at: float = 0.0
    persist: bool = True  # False: its writer asked for memory and peer only (until a drain)
    ahead: bool = False  # reserved a step before its save: nobody copies into it yet

    @property
    def key(self) -> tuple[int, int]:
        return self.step, self.rank

    @property
    def generation(self) -> int:
        """The generation that saved this shard (UNKNOWN until its header is known: saved_by)."""
        return saved_by(self.header.timeline if self.header else None)


def shard_age(shard: Shard) -> tuple[int, int]:
    """How new a shard is: by the generation that saved it, then by step. A generation that
    restarted from an earlier step (a rollback, a fresh start, a shrink) saves lower step numbers
    than the history it abandoned, and its saves are the newer ones: memory must keep those."""
    return shard.generation, shard.step


class ShardMemory:
    """The shards of one server and the regions behind them, within `budget_bytes`.

    `on_evict(shard)` is called (lock held: it must not block) for each evicted shard that was
    in the memory tier, so it can be withdrawn from the catalog.
    """

    def __init__(
        self,
        regions: RegionDir,
        budget_bytes: int,
        memory_keep: int,
        node: str,
        on_evict: Callable[[Shard], None] = lambda shard: None,
        budget_source: str = "the configured checkpoint memory budget",
    ):
        self.regions = regions
        self.budget_bytes = budget_bytes
        self.budget_source = budget_source  # what sets the budget (capacity.py), for refusals
        self.memory_keep = memory_keep
        self.node = node
        self.on_evict = on_evict
        self.lock = threading.Condition()
        self.shards: dict[tuple[int, int], Shard] = {}
        self.free: list[Region] = []
        self.used = 0
        self.preparing = 0  # spare regions being populated right now
        self.released = False  # release_all ran: no new region is made
        self.protected_step: int | None = None  # the plan's restore step: never evicted
        # Whether a shard falls under a discard (the server's publisher knows): such a shard is
        # evicted as soon as nothing reads it (`drop_discarded`, `unpin`).
        self.discarded: Callable[[Shard], bool] = lambda shard: False

    def reserve(
        self,
        step: int,
        rank: int,
        nbytes: int,
        world_size: int,
        origin: str = LOCAL,
        ahead: bool = False,
    ) -> Region:
        """A region for shard (step, rank), recycled or new; BudgetExceeded when it cannot fit.
        `ahead`: reserved a step before its save (Shard.ahead)."""
        with self.lock:
            old = self.shards.get((step, rank))
            if old is not None:
                if old.state != COMMITTED or old.pins:
                    raise BudgetExceeded(
                        f"step {step} rank {rank} is being saved or transferred already"
                    )
                self.evict(old)
            region = self._take_free(nbytes, rank)
            if region is None and self.preparing:  # a spare being populated: the one to use
                self.lock.wait_for(lambda: not self.preparing, timeout=PREPARING_WAIT_S)
                region = self._take_free(nbytes, rank)
            if region is None:
                reclaimable = sum(r.nbytes for r in self.free) + sum(
                    s.region.nbytes for s in self._victims()
                )
                if self.used - reclaimable + nbytes > self.budget_bytes:  # refuse, evict nothing
                    held = sorted({s.step for s in self.shards.values()})
                    raise BudgetExceeded(
                        f"save of step {step} rank {rank} ({nbytes} bytes) does not fit the "
                        f"checkpoint memory budget of {self.budget_bytes} bytes on node "
                        f"{self.node}, set by {self.budget_source} ({self.used} in use, holding "
                        f"steps {held}); raise --ckpt-memory or free shared memory"
                    )
                while region is None and self.used + nbytes > self.budget_bytes:
                    victims = self._victims()
                    if victims:
                        self.evict(victims[0])
                        region = self._take_free(nbytes, rank)
                    else:
                        self._destroy(self.free.pop(0))
            if region is not None:
                self.shards[(step, rank)] = Shard(
                    step, rank, world_size, region, origin, ahead=ahead
                )
                return region
            self.used += nbytes
        try:
            region = self.regions.new(nbytes)  # slow (page population): outside the lock
        except OSError as e:
            with self.lock:
                self.used -= nbytes
            raise BudgetExceeded(
                f"cannot create a shared-memory region of {nbytes} bytes: {e}"
            ) from e
        with self.lock:
            self.shards[(step, rank)] = Shard(step, rank, world_size, region, origin, ahead=ahead)
        return region

    def fits_without_evicting(self, nbytes: int) -> bool:
        """Whether `reserve` of `nbytes` would evict nothing: a free region of that size, or room
        in the budget for a new one (lock held)."""
        return any(r.nbytes == nbytes for r in self.free) or (
            self.used + nbytes <= self.budget_bytes
        )

    def _take_free(self, nbytes: int, rank: int) -> Region | None:
        """A free region of exactly `nbytes`, the one prepared for `rank` first (its worker
        mapped it)."""
        fits = [i for i, r in enumerate(self.free) if r.nbytes == nbytes]
        mine = [i for i in fits if self.free[i].prepared_for == rank]
        if not fits:
            return None
        region = self.free.pop((mine or fits)[0])
        region.prepared_for = None
        return region

    def _victims(self) -> list[Shard]:
        """Shards that may go, oldest first: complete, idle, not their rank's newest, not the
        restore step."""
        newest: dict[int, tuple[int, int]] = {}
        for s in self.shards.values():
            if s.state == COMMITTED:
                newest[s.rank] = max(newest.get(s.rank, (-2, -1)), shard_age(s))
        candidates = [
            s
            for s in self.shards.values()
            if s.state == COMMITTED
            and not s.pins
            and shard_age(s) != newest[s.rank]
            and s.step != self.protected_step
        ]
        return sorted(candidates, key=shard_age)

    def evict(self, shard: Shard) -> None:
        """Drop a shard (lock held); its region goes to the free pool unless a worker loaded
        from it."""
        del self.shards[shard.key]
        if Tier.MEMORY in shard.tiers:
            self.on_evict(shard)
        shard.tiers.discard(Tier.MEMORY)
        if shard.region.loaned:
            self._destroy(shard.region)
        else:
            self.free.append(shard.region)
        self.lock.notify_all()

    def _destroy(self, region: Region) -> None:
        self.used -= region.nbytes
        region.destroy()

    def abort(self, step: int, rank: int, region: Region) -> None:
        """Give back a reserved region whose copy did not finish."""
        with self.lock:
            shard = self.shards.get((step, rank))
            if shard is not None and shard.region is region and shard.state == RESERVED:
                del self.shards[(step, rank)]
                self.free.append(region)
                self.lock.notify_all()

    def retain(self, rank: int) -> None:
        """Evict this rank's complete shards beyond the `memory_keep` newest, and beyond two
        while the newest is memory-only (lock held): when a rank dies before saving a step its
        peers saved, the job restores the step before, which storage then does not hold. The
        extra step goes first when the budget is short (`_victims`)."""
        mine = self._complete_of(rank)
        for s in mine[self._keep(mine) :]:
            if not s.pins and s.step != self.protected_step:
                self.evict(s)

    def _complete_of(self, rank: int) -> list[Shard]:
        """This node's complete shards of `rank`, newest first (lock held)."""
        return sorted(
            (s for s in self.shards.values() if s.rank == rank and s.state == COMMITTED),
            key=shard_age,
            reverse=True,
        )

    def _keep(self, mine: list[Shard]) -> int:
        """How many of a rank's complete shards (`mine`, newest first) memory keeps."""
        return max(self.memory_keep, 2) if mine and not mine[0].persist else self.memory_keep

    def prepare_spare(self, nbytes: int, rank: int, persist: bool | None = None) -> Region | None:
        """A populated region of `nbytes` ready for `rank`'s next save, if the budget has room.
        With `persist` given (a worker's `prepare` before its first save), regions for the saves
        after it too: as many as a rotation of such saves uses (the steps memory keeps of them and
        the save in progress), so that no first save waits for a region being made (the 3rd save
        of 1 GiB did: its region, made after the 2nd, took 2 s here). A spare being populated by
        another thread (the finaliser's, a worker's `prepare`) is waited for, so two callers
        never make two spares."""
        while True:
            with self.lock:
                if self.preparing:
                    self.lock.wait_for(lambda: not self.preparing, timeout=PREPARING_WAIT_S)
                held = self._complete_of(rank)
                if persist is None:  # one spare, within the steps kept and one save
                    kept, wanted = self._keep(held), 1
                else:  # the rotation: the steps kept of such saves and one save, less those held
                    kept = self.memory_keep if persist else max(self.memory_keep, 2)
                    wanted = max(1, kept + 1 - len(held))
                ready = [
                    r for r in self.free if r.nbytes == nbytes and r.prepared_for in (rank, None)
                ]
                for spare in ready[:wanted]:
                    spare.prepared_for = rank
                if len(ready) >= wanted or self.released:
                    return ready[0] if ready else None
                if self.used + nbytes > self.budget_bytes or self._regions_of(rank) > kept:
                    return ready[0] if ready else None  # beyond the budget, or the rotation
                self.used += nbytes
                self.preparing += 1
            region = None
            try:
                region = self.regions.new(nbytes)
            except OSError:
                pass
            with self.lock:
                self.preparing -= 1
                if region is not None and self.released:  # the server stopped meanwhile
                    region.destroy()
                    region = None
                if region is None:
                    self.used -= nbytes
                else:
                    region.prepared_for = rank
                    self.free.append(region)
                self.lock.notify_all()
            if region is None:
                return ready[0] if ready else None

    def _regions_of(self, rank: int) -> int:
        """Regions this node's workers of `rank` hold: their shards and spares (lock held)."""
        shards = sum(1 for s in self.shards.values() if s.rank == rank and s.origin == LOCAL)
        return shards + sum(1 for r in self.free if r.prepared_for == rank)

    def pin(self, shard: Shard) -> bool:
        """Keep `shard` from eviction while its region is read; False when it is gone already."""
        with self.lock:
            if self.shards.get(shard.key) is not shard:
                return False
            shard.pins += 1
            return True

    def unpin(self, shard: Shard) -> None:
        """The end of a read of `shard`; once nothing reads it, it goes if retention or a
        discard wanted it gone meanwhile (its region is then free for the next save, instead of
        the next save making a new one that its worker has not mapped)."""
        with self.lock:
            shard.pins -= 1
            if not self.drop_if_discarded(shard) and not shard.pins and shard.origin == LOCAL:
                self.retain(shard.rank)
            self.lock.notify_all()

    def drop_discarded(self) -> None:
        """Evict every complete shard that falls under a discard and that nothing reads now (the
        others go when their last reader unpins them, or when they complete)."""
        with self.lock:
            for shard in list(self.shards.values()):
                self.drop_if_discarded(shard)

    def drop_if_discarded(self, shard: Shard) -> bool:
        """Evict `shard` (lock held) if it is complete, unread, still held and discarded."""
        if (
            shard.state == COMMITTED
            and not shard.pins
            and self.shards.get(shard.key) is shard
            and self.discarded(shard)
        ):
            self.evict(shard)
            return True
        return False

    def held(self, rank: int) -> list[tuple[int, int]]:
        """(step, world size) of each shard of `rank` in memory: checksummed, or being
        checksummed (a save committed a moment ago; `locate` waits for it)."""
        with self.lock:
            return [
                (s.step, s.world_size)
                for s in self.shards.values()
                if s.rank == rank
                and s.world_size > 0
                and (Tier.MEMORY in s.tiers or (s.state == STAGED and Tier.MEMORY not in s.failed))
            ]

    def holding(self, tier: Tier) -> list[Shard]:
        """The shards that reached `tier`."""
        with self.lock:
            return [s for s in self.shards.values() if tier in s.tiers]

    def status(self, node: str, addr: str, prefetch: list[PrefetchStatus]) -> Status:
        """What the `status` request shows: use, free regions, every shard's state and tiers
        (and, as given, the server's node and address and its prefetches)."""
        with self.lock:
            shards = [
                ShardStatus(
                    s.step,
                    s.rank,
                    s.state,
                    sorted(t.value for t in s.tiers),
                    s.origin,
                    {t.value: why for t, why in s.failed.items()},
                )
                for s in self.shards.values()
            ]
            free = [r.nbytes for r in self.free]
            return Status(node, addr, self.used, self.budget_bytes, free, shards, prefetch)

    def release_all(self) -> None:
        """Destroy every region (the server stops), after any spare being populated: one made
        during the removal of the folder would keep it in /dev/shm."""
        with self.lock:
            self.released = True
            self.lock.wait_for(lambda: not self.preparing, timeout=PREPARING_WAIT_S)
            for shard in self.shards.values():
                shard.region.destroy()
            for region in self.free:
                region.destroy()
            self.shards.clear()
            self.free.clear()
        self.regions.remove()
