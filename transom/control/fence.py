"""A node agent's fence rule: what a node cut off from etcd does with its workers, when.

The workers' collectives run on their own store (the generation's TorchStore), so they never
need etcd; what the agent must never do is let old workers run once the controller may have
started the next generation without this node. The controller can do that only after this
node's lease expired (then `settle_s`, a tick, the survivors' start). The lease outlives its
last renewal by the TTL, counted by etcd from when the renewal reached it, which is after the
agent sent it; the agent counts "cut off" from the sending of the newest renewal etcd answered
(its own monotonic clock, never compared with another machine's: `NodeContact.reached_at`,
transom.control.node_contact, which owns that clock and the thresholds that count from it). So,
with `cut_off_s` that:

- below PAUSE_TTL_SHARE x the node TTL (6 s of the default 8 s): nothing changes, the workers
  train on (a short stall costs nothing at all);
- from there, or at once when etcd said the lease expired: `pause_due` says to freeze the
  workers (SIGSTOP): from then on no instruction of the old generation runs on this node, before
  its lease can expire, so an old and a new generation never overlap, whatever the network
  does. A paused worker keeps its memory, its sockets and its place in the collective;
- when etcd answers again and the newest plan still has this node in the same generation (etcd
  stalled for everyone: nobody could write a new plan), the agent resumes the workers: no
  restart, no eviction, the only cost is the pause. If the plan evicted this node or went on to
  another generation, the paused workers are killed without running again;
- at `store_outage_s` (--store-outage) `fence_due` says to give up: an outage that long is
  no longer ridden out; the workers are killed and reported as fenced once etcd is back, and the
  controller restarts the generation.

Why not train on through a long stall, as the agent once did: it cannot tell "etcd is down for
everyone" from "only this node is cut off" until etcd answers, and in the second case its
workers would still be running when the survivors start the next generation (measured 0.8-2.0
s of overlap: the worker failing on the broken collective and exiting). A longer `--node-ttl`
buys a longer stall trained through.

`PauseGuard` applies the pause rule from its own thread: the agent's loop may sit in an etcd
call for the store's whole deadline (4 s) just when etcd stops answering. It sleeps until the
pause would be due (or the lease keeper says the lease expired) rather than polling, and then
every GUARD_TICK_S while the pause is due.
`fenced` is the failure a fenced node reports. `until_reached` retries a start-up step while
etcd cannot be reached. This module never calls etcd itself and never signals anything; the
agent does, on its answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from transom.common.records import FailureKind, FailureReport
from transom.store.access import StoreError

if TYPE_CHECKING:
    from transom.control.lease_keeper import LeaseKeeper

log = logging.getLogger("transom.agent")

GUARD_TICK_S = 0.1  # the guard's period while a pause is due (and its least sleep)
# How long start-up (spec, checkpoint secret, registration) waits for etcd before giving up.
STARTUP_WAIT_S = 300.0
STARTUP_RETRY_S = 1.0
T = TypeVar("T")


def fenced(reason: str) -> FailureReport:
    """The failure a fenced node reports (its workers killed for `reason`): a peer's error, as
    the node's cut-off from etcd is to blame, not its workers."""
    return FailureReport(FailureKind.FENCED, reason, time.time(), peer_error=True)


class PauseGuard:
    """Calls `pause(reason)` whenever the lease keeper's contact says a pause is due
    (`NodeContact.pause_due`, with the keeper's `lost`); the callback must be cheap and
    idempotent: it pauses running workers, or does nothing."""

    def __init__(
        self, keeper: LeaseKeeper, pause: Callable[[str], None], stopping: threading.Event
    ) -> None:
        self.keeper, self.pause, self.stopping = keeper, pause, stopping
        self._thread = threading.Thread(target=self._run, name="pause-guard", daemon=True)

    def start(self) -> None:
        """Guard from now on (the contact's TTL is set by then)."""
        self._thread.start()

    def due(self) -> str | None:
        return self.keeper.contact.pause_due(time.monotonic(), self.keeper.lost.is_set())

    def _sleep_s(self) -> float:
        """How long nothing can become due but the lease's loss: until the cut-off reaches the
        pause (a renewal answered meanwhile only puts that later)."""
        return max(GUARD_TICK_S, self.keeper.contact.pause_in_s(time.monotonic()))

    def _run(self) -> None:
        while not self.stopping.is_set():
            reason = self.due()
            if reason is None:
                self.keeper.lost.wait(self._sleep_s())  # set: etcd said the lease expired
                continue
            try:
                self.pause(reason)
            except Exception:  # the guard must outlive any one failure
                log.exception("cannot pause the workers")
            self.stopping.wait(GUARD_TICK_S)


def until_reached(what: str, call: Callable[[], T], stopping: threading.Event) -> T:
    """`call()`, retried while it raises StoreError, for up to STARTUP_WAIT_S (or until
    `stopping`); then StoreError saying what could not be done."""
    started = time.monotonic()
    warned_at: float | None = None
    while True:
        try:
            return call()
        except StoreError as e:
            now = time.monotonic()
            if stopping.is_set() or now - started > STARTUP_WAIT_S:
                raise StoreError(f"cannot {what}: {e}") from e
            if warned_at is None or now - warned_at >= 30.0:
                warned_at = now
                log.warning("cannot %s yet (%s); retrying", what, e)
            stopping.wait(STARTUP_RETRY_S)
