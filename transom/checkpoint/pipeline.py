"""The save pipeline: what happens to a shard after its writer commits it, in the background.

commit -> the finaliser computes the checksums (the shard is then in the `memory` tier and
listed in the catalog) -> the replicator pushes it to the ring peer's server (`peer`) and the
persister writes it to storage (`storage`). Each tier reached or failed is recorded on the shard
(`wait` returns on either) and is an event. Background work waits (QUIET_WAIT_S at most) while a
worker of this node copies a save, so it does not compete with the copy for memory bandwidth
(a storage write also between its blocks, QUIET_BLOCK_WAIT_S at most: writing 1 GiB takes
seconds, a save's copy of it a tenth of one); the replicator and the persister skip a step
when they are behind and a newer one is queued (a save every step outpaces a slow peer or
disk: the newest step is what a restart needs). A save its writer made memory-only
(`Engine.save(..., persist=False)`) skips storage, except each rank's newest one when the
server drains (it stops, or an embedded server closes): the newest step outlives it.
Such a save (a snapshot every step) is no `saved` or `replicated` event, only its failures are.

This module never copies shard bytes in Python (checksums read the region in place, transfers
use sendfile, storage writes from the region) and never blocks a worker's save.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from transom.checkpoint import catalog, replication, shard_format, storage
from transom.checkpoint.budget import (
    COMMITTED,
    LOCAL,
    RESERVED,
    STAGED,
    Shard,
    ShardMemory,
    shard_age,
)
from transom.checkpoint.publisher import Publisher
from transom.checkpoint.server_options import ServerConfig
from transom.checkpoint.shm import Region
from transom.checkpoint.worker_protocol import Failed, Reached
from transom.common.states import Tier
from transom.store import StoreError

log = logging.getLogger("transom.ckpt.server")

REPLICATE_ATTEMPTS = 3
PERSIST_RETRY_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# Background work (checksums, replication, persistence) waits this long at most for saves in
# progress on this node to finish, so it does not compete with their copies for CPU and memory
# bandwidth.
QUIET_WAIT_S = 5.0
# A storage write waits this long at most between its blocks while a worker copies a save (the
# copy of 1 GiB takes 0.05-0.1 s here; a worker stopped mid-copy must not stall storage).
QUIET_BLOCK_WAIT_S = 0.5
NO_PEER = "no peer"
MEMORY_ONLY = "not persisted: saved for memory and peer only (persist=False)"


class SavePipeline:
    def __init__(
        self,
        cfg: ServerConfig,
        memory: ShardMemory,
        publisher: Publisher,
        stopping: threading.Event,
    ):
        self.cfg = cfg
        self.node = cfg.node_id
        self.memory = memory
        self.lock = memory.lock
        self.publisher = publisher
        self.stopping = stopping
        self.finalize_q: queue.Queue[Shard | None] = queue.Queue()
        self.replicate_q: queue.Queue[Shard | None] = queue.Queue()
        self.persist_q: queue.Queue[Shard | None] = queue.Queue()
        self.pusher = replication.Pusher(cfg.secret)  # the replicator thread's connections

    def threads(self) -> list[tuple[Callable[[], None], str]]:
        """(target, name) of the pipeline's threads."""
        return [
            (self._finalizer, "ckpt-finalize"),
            (self._replicator, "ckpt-replicate"),
            (self._persister, "ckpt-persist"),
        ]

    def stop(self) -> None:
        for q in (self.finalize_q, self.replicate_q, self.persist_q):
            q.put(None)

    def commit(
        self, step: int, rank: int, region: Region, header: shard_format.ShardHeader, persist: bool
    ) -> None:
        """The worker finished copying: checksums and the rest happen in the background; not
        `persist`: memory and peer only, storage at a drain if it is still its rank's newest."""
        with self.lock:
            shard = self.memory.shards.get((step, rank))
            if shard is None or shard.region is not region or shard.state != RESERVED:
                raise shard_format.ShardError(
                    f"step {step} rank {rank} was not reserved by this connection"
                )
            shard.header = header
            shard.persist = persist
            shard.state = STAGED
            shard.staged_at = time.time()
            self.lock.notify_all()
        self.finalize_q.put(shard)

    def committed(self, shard: Shard) -> bool:
        """`shard` is complete (checksummed here, or verified on arrival from a peer); False
        when it fell under a discard meanwhile, or is older than the steps memory keeps of its
        rank (then it is evicted, never listed)."""
        with self.lock:
            shard.state = COMMITTED
            if self.memory.drop_if_discarded(shard):
                return False
            shard.tiers.add(Tier.MEMORY)
            self.memory.retain(shard.rank)
            self.lock.notify_all()
            if self.memory.shards.get(shard.key) is not shard:
                return False  # evicted at once (older than the steps kept): never listed
        self.publisher.list_memory(shard)
        return True

    def discard_stored(self, marks: list[catalog.Discard]) -> list[int]:
        """Remove what the discards `marks` cover from the storage directory (if any); the
        steps touched."""
        if self.cfg.storage_dir is None:
            return []
        touched: set[int] = set()
        for mark in marks:
            try:
                touched.update(
                    storage.discard_steps(
                        Path(self.cfg.storage_dir),
                        mark.first_bad_step,
                        mark.generation,
                        self.cfg.job_id,
                    )
                )
            except OSError as e:
                log.warning("cannot remove discarded steps from storage: %s", e)
        return sorted(touched)

    def wait(self, step: int, rank: int, tier: Tier, timeout: float | None) -> Reached | Failed:
        """The reply to a worker's `wait`: once shard (step, rank) reached or failed `tier`."""
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        with self.lock:
            while True:
                shard = self.memory.shards.get((step, rank))
                if shard is None:
                    return Failed(
                        f"step {step} rank {rank} is not held by this server "
                        "(never saved here, evicted, or discarded)"
                    )
                if tier in shard.tiers:
                    return Reached(sorted(shard.tiers))
                if tier in shard.failed:
                    return Failed(shard.failed[tier])
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return Failed(f"{tier} not reached within {timeout} s", timeout=True)
                self.lock.wait(left if left is not None else 1.0)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Persist each rank's newest memory-only shard, then wait until every shard this node's
        workers saved is in storage, or failed to get there, or was evicted (a stopping server,
        an embedded server's `close`); False when `timeout_s` ran out."""
        self._persist_newest()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.lock:
            shards = [s for s in self.memory.shards.values() if s.origin == LOCAL]
        for s in shards:
            with self.lock:
                while (
                    (s.state != COMMITTED or Tier.STORAGE not in s.tiers)
                    and Tier.STORAGE not in s.failed
                    and Tier.MEMORY not in s.failed
                    and self.memory.shards.get(s.key) is s
                ):
                    left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                    if left <= 0:
                        return False
                    self.lock.wait(left)
        return True

    def _persist_newest(self) -> None:
        """Queue for storage each rank's newest shard of this node saved memory-only (every
        server of a stopping job writes the same step: its newest is complete in storage)."""
        if self.cfg.storage_dir is None:
            return
        queued = []
        with self.lock:
            newest: dict[int, Shard] = {}
            for s in self.memory.shards.values():
                if s.origin == LOCAL and s.state != RESERVED:
                    if s.rank not in newest or s.step > newest[s.rank].step:
                        newest[s.rank] = s
            for s in newest.values():
                s.persist = True  # a shard still being checksummed is queued by the finaliser
                if s.failed.get(Tier.STORAGE) == MEMORY_ONLY:
                    del s.failed[Tier.STORAGE]
                    queued.append(s)
        for s in queued:
            self.persist_q.put(s)

    def persist_later(self, step: int, rank: int) -> bool:
        """Send shard (step, rank), saved here memory-only, to storage too (a worker's `Persist`:
        a framework that snapshots every step saves a checkpoint of the same step); False when
        memory does not hold it."""
        with self.lock:
            shard = self.memory.shards.get((step, rank))
            if shard is None or shard.origin != LOCAL or shard.state == RESERVED:
                return False
            shard.persist = True  # a shard still being checksummed is queued by the finaliser
            queued = shard.failed.pop(Tier.STORAGE, None) == MEMORY_ONLY
        if queued:
            self.persist_q.put(shard)
        return True

    def _to_storage(self, shard: Shard) -> None:
        """Queue a committed shard for storage, unless its writer made it memory-only."""
        with self.lock:  # decided under the lock a drain's `_persist_newest` takes
            if not shard.persist:
                shard.failed[Tier.STORAGE] = MEMORY_ONLY
                self.lock.notify_all()
                return
        self.persist_q.put(shard)

    def _routine(self, shard: Shard, action: str, message: str, **fields: object) -> None:
        """The event of a tier reached, for a save that goes to storage; a memory-only save
        (a snapshot every step) reaches its tiers without one: its failures are events."""
        if shard.persist:
            self.publisher.event(action, message, **fields)

    def _reached(self, shard: Shard, tier: Tier) -> None:
        with self.lock:
            shard.tiers.add(tier)
            self.lock.notify_all()

    def _fail(self, shard: Shard, tier: Tier, reason: str) -> None:
        with self.lock:
            shard.failed[tier] = reason
            self.lock.notify_all()

    def _quiet(self, limit_s: float = QUIET_WAIT_S) -> None:
        """Wait until no worker of this node is copying a save (at most `limit_s`). A region
        reserved ahead of its save is no copy under way: with a save every step one always is,
        and each step's checksums and replica waited for the next step's commit (the last
        step's for QUIET_WAIT_S, twice, as the job ended)."""
        with self.lock:
            self.lock.wait_for(
                lambda: (
                    not any(
                        s.state == RESERVED and not s.ahead for s in self.memory.shards.values()
                    )
                ),
                timeout=limit_s,
            )

    # -- memory: checksums -------------------------------------------------------------------
    def _finalizer(self) -> None:
        while (shard := self.finalize_q.get()) is not None:
            self._quiet()
            try:
                header = shard.header
                if header is None:
                    raise shard_format.ShardError("committed without a header")
                data = shard.region.view()[: header.data_len]
                header = shard.header = header.with_chunks(shard_format.checksum_data(data))
                del data
                shard.header_bytes = shard_format.encode_header(header)
            except Exception as e:  # noqa: BLE001 - a broken header: the shard is not usable
                self._fail(shard, Tier.MEMORY, f"cannot finalize: {e}")
                with self.lock:
                    if shard.key in self.memory.shards and self.memory.shards[shard.key] is shard:
                        self.memory.evict(shard)
                continue
            if not self.committed(shard):
                self._fail(shard, Tier.MEMORY, "discarded, or older than the steps kept")
                continue
            self._routine(
                shard,
                "saved",
                f"step {shard.step} rank {shard.rank} saved in memory on {self.node} "
                f"({shard.region.nbytes} bytes)",
                step=shard.step,
                rank=shard.rank,
                tier=Tier.MEMORY,
                staged=shard.staged_at,
            )
            if self.cfg.replicas > 0:
                self.replicate_q.put(shard)
            else:
                self._fail(shard, Tier.PEER, "replication is off (replicas=0)")
            if self.cfg.storage_dir is not None:
                self._to_storage(shard)
            else:
                self._fail(shard, Tier.STORAGE, "no storage directory configured")
            self.memory.prepare_spare(shard.region.nbytes, shard.rank)

    # -- peer: replication ---------------------------------------------------------------------
    def _peer_addr(self, fresh: bool) -> tuple[str | None, str]:
        """(peer address, its node) for this node's replicas, per the ring of the plan's
        members; (None, why) when there is none. The address is read again when `fresh`."""
        if self.cfg.peer:
            return self.cfg.peer, self.cfg.peer
        peer = replication.ring_peer(self.publisher.plan.members, self.node)
        if peer is None or self.publisher.store is None:
            return None, f"{NO_PEER} node (a single node, or this node is not a member)"
        addr = self.publisher.peer_addr(peer, fresh)
        if addr is None:
            return None, f"peer {peer}'s checkpoint server is not registered"
        return addr, peer

    def _replicator(self) -> None:
        try:
            self._replicate_queued()
        finally:
            self.pusher.close()

    def _replicate_queued(self) -> None:
        while (shard := self.replicate_q.get()) is not None:
            if self._superseded(shard) and not self.replicate_q.empty():
                self._fail(shard, Tier.PEER, "skipped: replication is behind, a newer step is due")
                continue
            self._quiet()
            if not self.memory.pin(shard):
                self._fail(shard, Tier.PEER, "evicted before it was replicated")
                continue
            try:
                self._replicate(shard)
            finally:
                self.memory.unpin(shard)

    def _replicate(self, shard: Shard) -> None:
        assert shard.header is not None  # committed shards have one
        error = None
        for attempt in range(REPLICATE_ATTEMPTS):
            try:
                addr, peer = self._peer_addr(fresh=attempt > 0)
                if addr is None:
                    error = peer
                    break
                t0 = time.time()
                self.pusher.push(
                    addr,
                    shard.header,
                    shard.header_bytes,
                    shard.region.path,
                    self.node,
                )
                self._reached(shard, Tier.PEER)
                self._routine(
                    shard,
                    "replicated",
                    f"step {shard.step} rank {shard.rank} replicated to {peer}",
                    step=shard.step,
                    rank=shard.rank,
                    tier=Tier.PEER,
                    peer=peer,
                    duration_s=time.time() - t0,
                )
                return
            except (replication.ReplicationError, StoreError) as e:
                error = str(e)
                time.sleep(0.2 * (attempt + 1))
        assert error is not None
        self._fail(shard, Tier.PEER, error)
        if NO_PEER not in error:
            self.publisher.event(
                "failed",
                f"step {shard.step} rank {shard.rank} not replicated: {error}",
                step=shard.step,
                rank=shard.rank,
                tier=Tier.PEER,
                error=error,
            )

    # -- storage: persistence ------------------------------------------------------------------
    def _superseded(self, shard: Shard) -> bool:
        """Whether this node's workers saved a newer step of `shard`'s rank (copied already)."""
        with self.lock:
            return any(
                s.rank == shard.rank
                and shard_age(s) > shard_age(shard)
                and s.origin == LOCAL
                and s.state != RESERVED
                for s in self.memory.shards.values()
            )

    def _persister(self) -> None:
        while (shard := self.persist_q.get()) is not None:
            if self._superseded(shard) and not self.persist_q.empty():
                self._fail(
                    shard, Tier.STORAGE, "skipped: storage is behind and a newer step is queued"
                )
                continue
            self._quiet()
            if not self.memory.pin(shard):
                self._fail(shard, Tier.STORAGE, "evicted before it was persisted")
                continue
            try:
                self._persist(shard)
            finally:
                self.memory.unpin(shard)

    def _persist(self, shard: Shard) -> None:
        assert shard.header is not None  # committed shards have one
        assert self.cfg.storage_dir is not None
        root = Path(self.cfg.storage_dir)
        for attempt, delay in enumerate((0.0, *PERSIST_RETRY_S)):
            if self.stopping.wait(delay):
                return
            if self.publisher.discarded(shard):
                self._fail(shard, Tier.STORAGE, "discarded before it was persisted")
                return
            try:
                t0 = time.time()
                root.mkdir(parents=True, exist_ok=True)
                data = shard.region.view()[: shard.header.data_len]
                timeline = shard.header.timeline
                path = storage.write_shard(
                    root,
                    shard.step,
                    shard.rank,
                    shard.header_bytes,
                    data,
                    timeline,
                    between=functools.partial(self._quiet, QUIET_BLOCK_WAIT_S),
                )
                del data
                removed = storage.complete_step(
                    root, shard.step, shard.world_size, self.cfg.storage_keep, timeline
                )
            except storage.StaleTimeline as e:
                self._fail(shard, Tier.STORAGE, str(e))
                return
            except OSError as e:
                retry = attempt < len(PERSIST_RETRY_S)
                self.publisher.event(
                    "failed",
                    f"step {shard.step} rank {shard.rank} not persisted to {root}: "
                    f"{e.strerror or e}{'; retrying' if retry else '; giving up'}",
                    step=shard.step,
                    rank=shard.rank,
                    tier=Tier.STORAGE,
                    error=str(e),
                )
                continue
            self.publisher.list_storage(shard, str(path), removed)
            if self.publisher.discarded(shard):  # came while writing: its sweep may have missed it
                self.discard_stored(self.publisher.discards)
                self._fail(shard, Tier.STORAGE, "discarded while it was persisted")
                return
            self._reached(shard, Tier.STORAGE)
            self.publisher.event(
                "persisted",
                f"step {shard.step} rank {shard.rank} persisted to {path}",
                step=shard.step,
                rank=shard.rank,
                tier=Tier.STORAGE,
                duration_s=time.time() - t0,
            )
            return
        self._fail(shard, Tier.STORAGE, f"storage {root} not writable")
