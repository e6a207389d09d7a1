"""`BatchWriter`: many small writes (events, checkpoint catalog entries) sent to etcd together, in
the background.

A checkpoint server writes an event for every state of every shard it holds (saved, replicated,
persisted) and lists and withdraws each shard in the catalog, each once as its own request. A
`BatchWriter` takes such writes (`put`, `delete`), waits LINGER_S for more (and at least until
SPACING_S after its previous send), and sends all that came in one transaction
(`Store.write_all`) from its own thread: the caller never waits for etcd, a burst of N writes
costs etcd one request, not N, and a writer costs etcd at most one request every SPACING_S
however often its owner writes (a server saving every step lists its saves and withdraws its
evicted steps once a second). A write that comes after a quiet SPACING_S
goes after LINGER_S alone. What must not wait for the spacing is sent after LINGER_S by
`hurry()` (or a `put(..., urgent=True)`): the owner's first listing of a generation, the
listings a restart will look for (a restarted worker loads from the fastest tier the catalog
lists: a listing 2 s late had workers restarted right after a save load from the peer or
storage instead of their node's memory, tests/test_checkpoint_e2e.py,
test_checkpoint_prefetch.py), and everything at `close()`. `flush()` sends at once, without
even LINGER_S (a checkpoint server's holdings when a recovery begins: the controller plans the
restore from them). A `lazy` write (a memory listing of a snapshot taken every step: only a
recovery reads it, and the owner flushes then) starts no send of its own: it goes with the next
send, or LAZY_S after it was queued, so a server that only snapshots costs etcd a request every
LAZY_S, not every SPACING_S.
Writes of one name keep their order (the last one queued is the one sent); writes of different
names may land in any order, and later than requests made directly, so it must not carry a write
whose order against another name's matters. A delete of a name this writer queued and never
sent cancels that put: neither goes. Nothing is lost to an etcd outage: writes that could
not be sent stay queued (in order) and go with the next attempt, after RETRY_S; only past
MAX_QUEUED writes are the oldest dropped, with a warning. A put under a lease that etcd no
longer has would fail its whole transaction forever: such puts are dropped (those under a lease
other than `live_lease()` first; if none, all leased ones: the owner lists again under its next
lease, as it must for whatever the lost lease took with it). `close()` sends what is queued
(within a deadline) and stops the thread. It never reads.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from transom.store.access import StoreError
from transom.store.etcd_client import Lease, Store

log = logging.getLogger(__name__)

LEASE_NOT_FOUND = "lease not found"  # etcd's answer to a put under a lease it does not have
LINGER_S = 0.2  # how long a first write waits for others to go with it
# The shortest time from one send to the next, unless hurried. 5 s cut a save-every-step job's
# catalog requests further, but the catalog then listed steps memory had evicted seconds before:
# plans named them, and the kill torture's restores fell below the plan's step.
SPACING_S = 1.0
RETRY_S = 1.0  # after a failed send
MAX_QUEUED = 10_000  # writes kept through an outage; beyond, the oldest are dropped
CLOSE_DEADLINE_S = 2.0
LAZY_S = 10.0  # the longest a lazy write waits for a send to go with
_ABSENT = object()


class BatchWriter:
    def __init__(
        self,
        store: Store,
        name: str = "batch-writer",
        live_lease: Callable[[], Lease | None] = lambda: None,
    ) -> None:
        self.store = store.with_deadline(CLOSE_DEADLINE_S)
        self.live_lease = live_lease
        self.sends = 0  # transactions sent
        self.failures = 0  # sends that failed (etcd unreachable); their writes were kept
        self.dead_lease_drops = 0  # puts dropped because etcd no longer had their lease
        # name -> (value, lease) to put, or None to delete; in the order last queued
        self._queued: dict[str, tuple[Any, Lease | None] | None] = {}
        self._dropped = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()  # something is queued
        self._nudge = threading.Event()  # hurried or closing: cut the wait short
        self._hurried = threading.Event()  # send after LINGER_S, whatever the spacing
        self._flushing = threading.Event()  # send now, not even after LINGER_S
        self._lazy: dict[str, float] = {}  # names queued lazily -> when
        self._sent: set[str] = set()  # names this writer put and has not deleted since
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(
        self,
        name: str,
        value: Any,
        lease: Lease | None = None,
        urgent: bool = False,
        lazy: bool = False,
    ) -> None:
        """Queue a write of `name` (under `lease`); it reaches etcd within about LINGER_S (or
        SPACING_S after the previous send, unless `urgent`: then `hurry()`; `lazy`: with the
        next send, LAZY_S at most)."""
        self._queue(name, (value, lease), lazy and not urgent)
        if urgent:
            self.hurry()

    def hurry(self) -> None:
        """Send what is queued (and what comes within LINGER_S) without waiting for SPACING_S
        since the previous send; it never waits for the send."""
        self._hurried.set()
        self._nudge.set()
        self._wake.set()

    def flush(self) -> None:
        """Send what is queued now: no LINGER_S, no SPACING_S; it never waits for the send."""
        self._flushing.set()
        self.hurry()

    def delete(self, name: str, lazy: bool = False) -> None:
        """Queue the deletion of `name`; it reaches etcd as a put would."""
        self._queue(name, None, lazy)

    def _queue(self, name: str, write: tuple[Any, Lease | None] | None, lazy: bool) -> None:
        with self._lock:
            if write is None and name not in self._sent and self._queued.get(name) is not None:
                # Deleting what this writer queued and never sent: neither goes (a snapshot
                # listed and evicted between two sends costs etcd nothing).
                del self._queued[name]
                self._lazy.pop(name, None)
                return
            self._queued.pop(name, None)  # the newest write of a name goes last
            self._queued[name] = write
            if lazy:
                self._lazy.setdefault(name, time.monotonic())
            else:
                self._lazy.pop(name, None)
            if len(self._queued) > MAX_QUEUED:
                oldest = next(iter(self._queued))
                del self._queued[oldest]
                self._lazy.pop(oldest, None)
                self._dropped += 1
        if not lazy:
            self._wake.set()

    def _lazy_due(self) -> float | None:
        """When the oldest lazy write queued must go (monotonic), None when there is none."""
        with self._lock:
            return min(self._lazy.values()) + LAZY_S if self._lazy else None

    def _wait_for_writes(self) -> None:
        """Until a write that starts a send is queued (or a hurry, a flush, a close), or the
        oldest lazy one is due; a lazy write queued meanwhile is seen within a second."""
        while True:
            due = self._lazy_due()
            wait = 1.0 if due is None else min(1.0, max(0.0, due - time.monotonic()))
            if self._wake.wait(wait) or (due is not None and time.monotonic() >= due):
                return

    @property
    def pending(self) -> int:
        """Writes queued and not yet sent."""
        with self._lock:
            return len(self._queued)

    def close(self, deadline_s: float = CLOSE_DEADLINE_S) -> None:
        """Send what is queued (giving up after `deadline_s`) and stop the thread."""
        self._closing.set()
        self._nudge.set()
        self._wake.set()
        self._thread.join(deadline_s + 1.0)

    def _linger(self, sent_at: float) -> None:
        """Wait LINGER_S for the rest of a burst, and until SPACING_S after the previous send
        (`sent_at`) unless hurried; not at all when closing."""
        linger_until = time.monotonic() + LINGER_S
        while not self._closing.is_set() and not self._flushing.is_set():
            until = linger_until
            if not self._hurried.is_set():
                until = max(until, sent_at + SPACING_S)
            left = until - time.monotonic()
            if left <= 0:
                return
            self._nudge.wait(left)
            self._nudge.clear()

    def _run(self) -> None:
        sent_at = -math.inf  # when the newest successful send began
        while True:
            self._wait_for_writes()
            self._linger(sent_at)  # let the rest of a burst come
            self._wake.clear()
            self._hurried.clear()  # what is queued now goes in this send
            self._flushing.clear()
            with self._lock:
                batch, dropped = dict(self._queued), self._dropped
                self._dropped = 0
            if dropped:
                log.warning("etcd unreachable: %d queued writes (the oldest) dropped", dropped)
            try:
                if batch:
                    began = time.monotonic()
                    self.store.write_all(batch)
                    self.sends += 1
                    sent_at = began
            except StoreError as e:
                if LEASE_NOT_FOUND in str(e) and self._drop_dead_lease_puts(batch):
                    self._wake.set()
                    continue
                self.failures += 1
                if self._closing.is_set():
                    log.warning("%d writes not sent before closing: %s", len(batch), e)
                    return
                log.info("%d writes not sent yet: %s", len(batch), e)
                self._wake.set()
                self._closing.wait(RETRY_S)
                continue
            with self._lock:
                for name, write in batch.items():
                    if write is None:
                        self._sent.discard(name)
                    else:
                        self._sent.add(name)
                    if self._queued.get(name, _ABSENT) is write:
                        del self._queued[name]
                        self._lazy.pop(name, None)
            if self._closing.is_set() and not self._queued:
                return

    def _drop_dead_lease_puts(self, batch: dict[str, tuple[Any, Lease | None] | None]) -> bool:
        """Drop the puts of `batch` under a dead lease (see the module doc); whether any."""
        leased = {n: w[1] for n, w in batch.items() if w is not None and w[1] is not None}
        live = self.live_lease()
        dead = [n for n, lease in leased.items() if live is None or lease.id != live.id]
        dead = dead or list(leased)
        with self._lock:
            for name in dead:
                if self._queued.get(name, _ABSENT) is batch[name]:
                    del self._queued[name]
                    self._lazy.pop(name, None)
        self.dead_lease_drops += len(dead)
        if dead:
            log.info("%d puts dropped: etcd no longer has their lease", len(dead))
        return bool(dead)
