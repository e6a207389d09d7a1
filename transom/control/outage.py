"""A node agent's fence rule: when a node cut off from etcd must stop its workers.

The agent keeps training through an etcd outage: its workers' collectives run on their own
store (the generation's TorchStore), so they never need etcd. What the agent must not do is
keep old workers alive once the controller may have started the next generation without this
node. `fence_reason` is that rule, with its numbers (all measured on the agent's own monotonic
clock, never compared with another machine's clock):

- Cut off for less than the node TTL: never fence. The lease may still hold, so the
  controller cannot have declared this node lost (it needs the lease to expire, then
  `settle_s`, then a tick to write the next generation).
- Cut off for at least the TTL, and the workers stopped making progress (no rank finished a
  step for `stall_s`) or a worker exited: fence now. Why this tells "this node is cut off"
  from "etcd is down for everyone": while etcd is down for everyone nobody can write a new
  plan, the other members keep their old workers, so the old collective goes on and this
  node's workers keep stepping. When only this node is cut off, the controller evicts it
  (lease expiry + settle_s) and every surviving member's agent stops its old workers before
  it starts new ones (`NodeAgent._follow`), which breaks the old collective: this node's
  workers can then not finish another step, so the old generation writes no new step, and
  they are stopped within `stall_s` + the workers' stop grace of that moment (in practice
  at once: gloo fails the collective when a peer's socket closes, a worker exits, the agent
  sees it on its next tick). The new generation's workers need their interpreter, torch and
  a rendezvous (seconds) before their first step.
- Cut off for at least `store_outage_s` (--store-outage): fence whatever the workers do; an
  outage that long is no longer ridden out (the node reports its workers as fenced once it
  reaches etcd again, and the controller restarts the generation).

How long the agent has been cut off is the agent's `StoreOutage` (transom.store.outage, the one
definition of an outage the launcher shares). `until_reached` retries a start-up step while etcd
cannot be reached. This module never calls etcd itself and never stops anything; the agent does,
on its answers.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from transom.store.access import StoreError

log = logging.getLogger("transom.agent")

# Workers that have not finished a step for this long (or STALL_STEPS times their median step
# time, if longer) are not making progress.
STALL_MIN_S = 5.0
STALL_STEPS = 4
# How long start-up (spec, checkpoint secret, registration) waits for etcd before giving up.
STARTUP_WAIT_S = 300.0
STARTUP_RETRY_S = 1.0
# What an agent does while etcd is unreachable (the log line that opens an outage says it).
RIDING_OUT = (
    "workers keep training unless the generation goes on without this node, "
    "for up to --store-outage"
)
T = TypeVar("T")


def stall_bound(step_times: Iterable[float]) -> float:
    """How long without a finished step means "not progressing", given recent step times."""
    times = [t for t in step_times if t and t > 0]
    return max(STALL_MIN_S, STALL_STEPS * statistics.median(times)) if times else STALL_MIN_S


def fence_reason(
    cut_off_s: float,
    quiet_s: float | None,
    stall_s: float,
    worker_exited: bool,
    ttl_s: float,
    outage_limit_s: float,
) -> str | None:
    """Why this node must stop its workers now, or None to keep them training.

    `cut_off_s`: seconds since the agent last reached etcd; `quiet_s`: seconds since a rank of
    this node last finished a step (None: none has in this generation, counted from the
    workers' start by the caller); `stall_s`: see `stall_bound`; `worker_exited`: a worker of
    the group already exited.
    """
    if cut_off_s < ttl_s:
        return None
    if cut_off_s >= outage_limit_s:
        return (
            f"cut off from etcd for {cut_off_s:.0f} s, longer than the job rides out "
            f"(--store-outage {outage_limit_s:.0f} s)"
        )
    if worker_exited:
        return f"cut off from etcd for {cut_off_s:.0f} s and a worker exited"
    if quiet_s is not None and quiet_s >= stall_s:
        return (
            f"cut off from etcd for {cut_off_s:.0f} s and no step finished for {quiet_s:.0f} s "
            f"(the generation may have gone on without this node)"
        )
    return None


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
