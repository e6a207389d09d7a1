"""How a node agent leaves: every shutdown step run even if another fails, and deregistration.

An agent that stops (the job ended, it was evicted, or a scheduler sent SIGTERM) must leave
nothing behind: workers, checkpoint server, warm interpreters, monitor socket, link-test port
and its node key. This module must never raise out of a shutdown: a step that fails is logged
and the next one still runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from transom.common import keys
from transom.common.records import Event, EventKind
from transom.store import Store, StoreError
from transom.store.etcd_client import Lease

log = logging.getLogger("transom.agent")


def close_all(*steps: tuple[str, Callable[[], object]]) -> None:
    """Run every (what, step) in order; a step that raises is logged and the next one runs."""
    for what, step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - the other steps must still run
            log.warning("shutdown: cannot %s: %s", what, e)


def deregister(store: Store, node_id: str, lease: Lease | None, terminated: bool) -> None:
    """Revoke the node's lease (its node key goes with it); after SIGTERM, say so in the events.

    A store that fails here is no error: the lease expires by itself within the node TTL."""
    if terminated:
        now = time.time()
        event = Event(now, EventKind.WARNING, f"{node_id} left the job: SIGTERM", writer=node_id)
        try:
            store.put(keys.event(now, f"{node_id}-leave"), event.to_dict())
        except StoreError:
            pass
    if lease is not None:
        try:
            store.revoke(lease)
        except StoreError:
            pass
