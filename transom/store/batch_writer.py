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
test_checkpoint_prefetch.py), and everything at `close()`.
Writes of one name keep their order (the last one queued is the one sent); writes of different
names may land in any order, and later than requests made directly, so it must not carry a write
whose order against another name's matters. Nothing is lost to an etcd outage: writes that could
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
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, name: str, value: Any, lease: Lease | None = None, urgent: bool = False) -> None:
        """Queue a write of `name` (under `lease`); it reaches etcd within about LINGER_S (or
        SPACING_S after the previous send, unless `urgent`: then `hurry()`)."""
        self._queue(name, (value, lease))
        if urgent:
            self.hurry()

    def hurry(self) -> None:
        """Send what is queued (and what comes within LINGER_S) without waiting for SPACING_S
        since the previous send; it never waits for the send."""
        self._hurried.set()
        self._nudge.set()
        self._wake.set()

    def delete(self, name: str) -> None:
        """Queue the deletion of `name`; it reaches etcd as a put would."""
        self._queue(name, None)

    def _queue(self, name: str, write: tuple[Any, Lease | None] | None) -> None:
        with self._lock:
            self._queued.pop(name, None)  # the newest write of a name goes last
            self._queued[name] = write
            if len(self._queued) > MAX_QUEUED:
                del self._queued[next(iter(self._queued))]
                self._dropped += 1
        self._wake.set()

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
        while not self._closing.is_set():
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
            self._wake.wait()
            self._linger(sent_at)  # let the rest of a burst come
            self._wake.clear()
            self._hurried.clear()  # what is queued now goes in this send
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
                for name in batch:
                    if self._queued.get(name, _ABSENT) is batch[name]:
                        del self._queued[name]
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
        self.dead_lease_drops += len(dead)
        if dead:
            log.info("%d puts dropped: etcd no longer has their lease", len(dead))
        return bool(dead)
