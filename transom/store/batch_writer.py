"""`BatchWriter`: many small writes of new keys (events) sent to etcd together, in the background.

A checkpoint server writes an event for every state of every shard it holds (saved, replicated,
persisted), each once as its own request. A `BatchWriter` takes such writes (`put`), waits
LINGER_S for more, and sends all that came in one transaction (`Store.put_all`) from its own
thread: the caller never waits for etcd, and a burst of N writes costs etcd one request, not N.

Nothing is lost to an etcd outage: writes that could not be sent stay queued (in order) and go
with the next attempt, after RETRY_S; only past MAX_QUEUED writes are the oldest dropped, with a
warning. `close()` sends what is queued (within a deadline) and stops the thread. It is for keys
written once (their names unique, like events'): it never reads and never deletes, and it must
not be used for writes whose order against other requests matters (they may land later).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from transom.store.access import StoreError
from transom.store.client import Store

log = logging.getLogger(__name__)

LINGER_S = 0.2  # how long a first write waits for others to go with it
RETRY_S = 1.0  # after a failed send
MAX_QUEUED = 10_000  # writes kept through an outage; beyond, the oldest are dropped
CLOSE_DEADLINE_S = 2.0


class BatchWriter:
    def __init__(self, store: Store, name: str = "batch-writer") -> None:
        self.store = store.with_deadline(CLOSE_DEADLINE_S)
        self.sends = 0  # transactions sent
        self.failures = 0  # sends that failed (etcd unreachable); their writes were kept
        self._queued: dict[str, Any] = {}
        self._dropped = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, name: str, value: Any) -> None:
        """Queue a write of `name` (a new key); it reaches etcd within about LINGER_S."""
        with self._lock:
            self._queued[name] = value
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
        self._wake.set()
        self._thread.join(deadline_s + 1.0)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if not self._closing.is_set():
                self._closing.wait(LINGER_S)  # let the rest of a burst come
            self._wake.clear()
            with self._lock:
                batch, dropped = dict(self._queued), self._dropped
                self._dropped = 0
            if dropped:
                log.warning("etcd unreachable: %d queued writes (the oldest) dropped", dropped)
            try:
                if batch:
                    self.store.put_all(batch)
                    self.sends += 1
            except StoreError as e:
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
                    if self._queued.get(name) is batch[name]:
                        del self._queued[name]
            if self._closing.is_set() and not self._queued:
                return
