"""`NodeContact`: when a node agent last reached etcd, and what follows from it, when.

An agent has one clock of its contact with etcd, `reached_at`: the agent's monotonic time at
which it sent the newest request of its lease that etcd answered. Two things feed it: each
answered lease renewal, even "this lease has expired" (the lease keeper's thread,
transom.control.lease_keeper), and the grant of a new lease when the node registers (the
agent's loop). Only requests of the lease count: a lease outlives its last renewal by the TTL,
counted by etcd from when the renewal reached it, which is after the agent sent it; another
call that etcd answered renews nothing, so counting from it could leave workers running after
the lease expired. (During an outage the agent's loop makes no other call anyway.) "Cut off" is
the time since `reached_at` on the same clock, never compared with another machine's.

Every threshold of the agent counts from it, with the node TTL (`ttl_s`):
- past OVERDUE_TTL_SHARE x the TTL (5/8: a renewal period and half the time its renewal has
  before the pause), or at once when a renewal or a call of the agent's loop fails, the agent is
  in an outage (`check`, `failed`; `outage` logs its start, its end and RIDING_OUT). The outage
  began at `reached_at` (as the agent's loop last read it) and ends with the next lease request
  etcd answers. Meanwhile the agent's reports wait; it reads the plan again afterwards;
- at PAUSE_TTL_SHARE x the TTL (3/4, 6 s of the default 8 s), or at once when etcd said the
  lease expired, its running workers are paused (`pause_due`, applied by the pause guard's
  thread, transom.control.fence, which says why and what follows);
- at --store-outage its workers are given up (`fence_due`).

Threads: the lease keeper's thread writes the clock and the renewals' error (`renewed`,
`renewal_failed`), the pause guard's thread reads the clock, and the agent's loop writes it
(`granted`) and alone uses the outage.
Pure bookkeeping: the caller passes the monotonic time; this module never calls etcd, never
signals a worker and never decides what the agent does beyond saying which threshold is past.
"""

from __future__ import annotations

import logging
import threading

from transom.store.access import StoreError
from transom.store.etcd_client import REFRESHES_PER_TTL
from transom.store.reachability import StoreOutage

log = logging.getLogger("transom.agent")

# Workers are paused once the agent has been cut off for this share of the node TTL: the
# rest of the TTL (2 s of the default 8 s) covers the agent's turn (0.2 s) and the signal. With
# renewals every half TTL (store.etcd_client.REFRESHES_PER_TTL), a renewal has a quarter of the
# TTL to be answered before a pause.
PAUSE_TTL_SHARE = 0.75
# No answer from etcd for this share of the node TTL is an outage: a renewal period (TTL /
# REFRESHES_PER_TTL) and half the time its renewal has before the pause.
OVERDUE_TTL_SHARE = (1 / REFRESHES_PER_TTL + PAUSE_TTL_SHARE) / 2
# What an agent does while etcd is unreachable (the log line that opens an outage says it).
RIDING_OUT = (
    f"workers train on for {PAUSE_TTL_SHARE:.0%} of the node TTL, then pause until etcd "
    "answers (resumed if the job still has this node), for up to --store-outage"
)


def pause_reason(cut_off_s: float, ttl_s: float, lease_lost: bool) -> str | None:
    """Why this node's running workers must be paused now, or None to let them train on."""
    if lease_lost:
        return "etcd said this node's lease expired"
    if cut_off_s >= PAUSE_TTL_SHARE * ttl_s:
        return (
            f"cut off from etcd for {cut_off_s:.1f} s: the node's lease ({ttl_s:g} s) may "
            "expire before etcd answers again"
        )
    return None


def fence_reason(cut_off_s: float, outage_limit_s: float) -> str | None:
    """Why this node must give its workers up now, or None to keep them (paused)."""
    if cut_off_s >= outage_limit_s:
        return (
            f"cut off from etcd for {cut_off_s:.0f} s, longer than the job rides out "
            f"(--store-outage {outage_limit_s:.0f} s)"
        )
    return None


class NodeContact:
    """One agent's contact with etcd (`who` names it in the outage's log lines), from `now`,
    when it began: until a lease request is answered, it counts as cut off from then."""

    def __init__(self, who: str, now: float, logger: logging.Logger = log) -> None:
        self.reached_at = now  # when the newest lease request etcd answered was sent
        self.error: StoreError | None = None  # the newest renewal's failure, if it failed
        self.ttl_s = 0.0  # the node TTL, set once the agent has read the job spec
        self.outage = StoreOutage(who, logger=logger, meanwhile=RIDING_OUT)
        self._lock = threading.Lock()  # `reached_at` is written by two threads
        self._checked = now  # `reached_at` as the agent's newest `check` read it

    # -- proofs of contact --------------------------------------------------------------------
    def renewed(self, asked_at: float) -> None:
        """A lease renewal sent at `asked_at` was answered (whatever etcd said of the lease)."""
        self._reached(asked_at)
        self.error = None

    def renewal_failed(self, error: StoreError) -> None:
        """The newest lease renewal failed (no answer, after the store's own retries)."""
        self.error = error

    def granted(self, asked_at: float) -> None:
        """A new lease, asked for at `asked_at`, was granted: its TTL counts from then."""
        self._reached(asked_at)

    def _reached(self, at: float) -> None:
        with self._lock:
            self.reached_at = max(self.reached_at, at)

    # -- what follows -------------------------------------------------------------------------
    def cut_off_s(self, now: float) -> float:
        """How long this node may have been cut off from etcd: seconds since `reached_at`."""
        return now - self.reached_at

    @property
    def in_outage(self) -> bool:
        return self.outage.in_outage

    def check(self, now: float) -> bool:
        """Whether the agent is in an outage now, by the renewals' word (the agent polls
        nothing): one began at `reached_at` when the newest renewal failed or the cut-off is
        past OVERDUE_TTL_SHARE of the TTL; one ends when a later lease request was answered."""
        reached = self._checked = self.reached_at  # once: the keeper's thread may move it
        if self.outage.since is not None and reached > self.outage.since:
            self.outage.ok(reached)
        error = self.error
        silent_s = now - reached
        if error is None and silent_s > OVERDUE_TTL_SHARE * self.ttl_s:
            error = StoreError(f"no answer to a lease renewal for {silent_s:.1f} s")
        if error is not None:
            self.outage.failed(error, began=reached)
        return self.outage.in_outage

    def failed(self, error: StoreError) -> None:
        """A store call of the agent's loop failed: an outage, begun when etcd last answered as
        the turn's `check` read it; so a lease request answered since ends it at the next."""
        self.outage.failed(error, began=self._checked)

    def pause_due(self, now: float, lease_lost: bool) -> str | None:
        """Why running workers must be paused now (`pause_reason`), or None."""
        return pause_reason(self.cut_off_s(now), self.ttl_s, lease_lost)

    def pause_in_s(self, now: float) -> float:
        """How long until the cut-off reaches the pause (negative: past it); an answered lease
        request meanwhile only puts it later."""
        return PAUSE_TTL_SHARE * self.ttl_s - self.cut_off_s(now)

    def fence_due(self, now: float, outage_limit_s: float) -> str | None:
        """Why the workers must be given up now (`fence_reason`, at --store-outage), or None."""
        return fence_reason(self.cut_off_s(now), outage_limit_s)
