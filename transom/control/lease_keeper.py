"""`LeaseKeeper`: keeps a node's lease alive, and tells its agent's contact clock each answer.

The agent registers its node under a lease (the node's death is the lease's expiry); this
thread renews it every `ttl / REFRESHES_PER_TTL` seconds. Every answer to a renewal, even "this
lease has expired", proves that etcd was reachable when it was asked: the keeper hands it (the
agent's monotonic time the request was sent), each failed renewal and each newly held lease's
grant to the agent's `NodeContact` (transom.control.node_contact), the one clock the agent's
outage handling counts from. The agent follows the plan through a watch and polls nothing, so
without these answers a node cut off from etcd would not notice that it is.

`lost` is set when etcd says the lease expired; the agent takes a new one and hands it over with
`hold`.

It never writes anything but the renewal, never raises into the agent's thread and never stops
workers: the agent decides what an outage means.
"""

from __future__ import annotations

import logging
import threading
import time

from transom.control.node_contact import NodeContact
from transom.store import Store, StoreError
from transom.store.etcd_client import REFRESHES_PER_TTL, Lease

log = logging.getLogger("transom.agent")


class LeaseKeeper:
    def __init__(self, store: Store, contact: NodeContact, stopping: threading.Event) -> None:
        self.store = store
        self.contact = contact
        self.interval_s = 1.0
        self.stopping = stopping
        self.lease: Lease | None = None
        self.lost = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keepalive", daemon=True)

    def hold(self, lease: Lease | None) -> None:
        """Renew `lease` from now on (None: renew nothing, e.g. once deregistered)."""
        self.lease = lease
        if lease is not None:
            self.contact.granted(lease.renewed_at)  # granted: etcd answered
            self.lost.clear()

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
            self.contact.renewal_failed(e)
            return
        self.contact.renewed(asked_at)
        if not alive and lease is self.lease and not self.lost.is_set():
            log.warning("node lease expired")
            self.lost.set()
