"""`LeaseKeeper`: keeps a node's lease alive, and is its agent's evidence that etcd answers.

The agent registers its node under a lease (the node's death is the lease's expiry); this
thread renews it every `ttl / REFRESHES_PER_TTL` seconds. Every answer to a renewal, even "this
lease has expired", proves that etcd was reachable when it was asked: `reached_at` (the agent's
monotonic clock, taken when the request was sent) is what the agent's outage handling counts
from (transom.control.fence: a lease outlives its last renewal by the TTL, so a node that has
not reached etcd for its TTL may have lost it). The agent follows the plan through a watch and
polls nothing, so without this signal a node cut off from etcd would not notice that it is.

`error` is the failure of the newest renewal (None once one succeeds again); `lost` is set when
etcd says the lease expired; the agent takes a new one and hands it over with `hold`.

It never writes anything but the renewal, never raises into the agent's thread and never stops
workers: the agent decides what an outage means.
"""

from __future__ import annotations

import logging
import threading
import time

from transom.store import Store, StoreError
from transom.store.etcd_client import REFRESHES_PER_TTL, Lease

log = logging.getLogger("transom.agent")


class LeaseKeeper:
    def __init__(self, store: Store, stopping: threading.Event) -> None:
        self.store = store
        self.interval_s = 1.0
        self.stopping = stopping
        self.lease: Lease | None = None
        self.lost = threading.Event()
        self.reached_at = time.monotonic()  # when the newest answered renewal was sent
        self.error: StoreError | None = None  # the newest renewal's failure, if it failed
        self._thread = threading.Thread(target=self._run, name="lease-keepalive", daemon=True)

    def hold(self, lease: Lease | None) -> None:
        """Renew `lease` from now on (None: renew nothing, e.g. once deregistered)."""
        self.lease = lease
        if lease is not None:
            self.reached_at = max(self.reached_at, lease.renewed_at)  # granted: etcd answered
            self.lost.clear()

    def cut_off_s(self, now: float) -> float:
        """How long this node may have been cut off from etcd: seconds since the newest renewal
        etcd answered was sent (what the fence rule counts, transom.control.fence)."""
        return now - self.reached_at

    def start(self, ttl_s: float) -> None:
        """Renew every `ttl_s / REFRESHES_PER_TTL` seconds until `stopping` is set."""
        self.interval_s = ttl_s / REFRESHES_PER_TTL
        self._thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self.renew()

    def renew(self) -> None:
        """One renewal of the held lease (a lost one too: its answer still proves contact)."""
        lease = self.lease
        if lease is None:
            return
        asked_at = time.monotonic()
        try:
            alive = self.store.refresh(lease)
        except StoreError as e:
            self.error = e
            return
        self.reached_at = asked_at
        self.error = None
        if not alive and lease is self.lease and not self.lost.is_set():
            log.warning("node lease expired")
            self.lost.set()
