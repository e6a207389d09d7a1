"""`StoreContact`: a controller's one steady store call, which also measures its gaps to etcd.

With watches the controller's ticks no longer read etcd, so they can no longer tell by
themselves that etcd stalled (a paused etcd keeps a watch stream open and silent). One thread
makes one small call every PROBE_S instead: the leader refreshes its leadership lease (the
keep-alive it needs anyway); a standby, every STANDBY_PROBE_S, reads the leader key (and
wakes its loop when the key is gone: a safety net under the leader-key watch, which wakes it
first). Each success is recorded in `Observed` with
the time the thread waited by choice left out, so a gap is a stretch in which calls failed or
stalled, not the prober's own pauses.

Before the controller acts on its watched view it asks `confirm(t)`: did a call succeed
after `t` and within STALE_S? If none did, it makes one at once and waits for it:
  - without an answer for STALE_S, etcd may be paused or down, and the view silently old;
  - a lease expiry the view saw at `t` may be etcd's own (it revokes every expired lease on
    resuming from a stall), so the controller acts on it only once a call that answered after
    it has recorded any gap that preceded it.

It never raises into the controller: a failed call is logged and retried at the next round.
`observed` is shared with the controller's thread; both use it under `lock`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from transom.control.observed import MIN_GAP_S, Observed
from transom.store import StoreError
from transom.store.etcd_client import REFRESHES_PER_TTL

log = logging.getLogger("transom.controller")

# The leadership lease: a standby takes over at most this long after the leader died (SIGKILL;
# one that stops hands over at once). 6 s, not 3 (issue 44: its renewal every 0.75 s was a
# third of a 2-node job's etcd requests).
LEADER_TTL_S = 6
# One call this often: the leader's lease is refreshed every 3 s, REFRESHES_PER_TTL times a TTL
# as every lease is (store.etcd_client); the same call keeps the leader's view confirmed
# (STALE_S). `confirm` makes a call of its own when the last is older than STALE_S. (Every 2 s
# before issue 44's last cut: on a 2-node job that third renewal was 0.08 etcd requests a node a
# second.)
PROBE_S = LEADER_TTL_S / REFRESHES_PER_TTL
# A standby's call: its watch on the leader key is what wakes it; this read is a safety net
# under the watch (15 s, not 5: issue 44).
STANDBY_PROBE_S = 15.0
# Without an answer this long, what the watches show may be old: a probe period and half a
# second for its answer, so that the steady probe keeps every tick's view confirmed without a
# call of its own (a tick a second made one a second at 1 s, issue 44). It bounds how much of an
# etcd stall a summary's age, as the controller acts on it, may hold. A hang needs every rank
# quiet for the hang floor (8 s by default) and HANG_STEP_FACTOR steps at least: a rank the
# summary said was stepping ages only past the agent's keep-alive, so in a stall it looks at
# most its stepping threshold (transom.monitor.detectors.stepping: 2 steps, 1 s at least) and
# STALE_S old, and a summary of ranks not stepping stands half the hang floor at most
# (transom.control.node_reports): both stay under the default hang timeout.
STALE_S = PROBE_S + MIN_GAP_S / 2


class StoreContact:
    """Runs `probe` (a store call; StoreError when etcd did not answer) every `period()`
    seconds (PROBE_S by default)."""

    def __init__(
        self,
        probe: Callable[[], None],
        observed: Observed,
        stopping: threading.Event,
        period: Callable[[], float] = lambda: PROBE_S,
    ):
        self.probe = probe
        self.period = period
        self.observed = observed
        self.lock = threading.Lock()  # guards `observed`
        self.stopping = stopping
        self.last_ok: float | None = None  # monotonic time of the newest success
        self._kick = threading.Event()
        self._answered = threading.Condition()  # notified at every success
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="store-contact", daemon=True)
            self._thread.start()

    def kick(self) -> None:
        """Make the next call now (and wait `period()` after it): a new leader's first refresh."""
        self._kick.set()

    def confirm(self, since: float, timeout: float) -> bool:
        """Whether etcd answered after `since` and within STALE_S; if not yet, a call is made
        at once (unless one is under way) and its answer awaited for up to `timeout` seconds."""

        def confirmed() -> bool:
            last = self.last_ok
            return last is not None and last >= since and time.monotonic() - last <= STALE_S

        if confirmed():
            return True
        with self._answered:
            self._kick.set()
            return self._answered.wait_for(confirmed, timeout)

    def _run(self) -> None:
        answered = False  # the previous round succeeded (so the wait before this one was idle)
        while not self.stopping.is_set():
            waited_from = time.monotonic()
            if self._kick.wait(self.period()):
                self._kick.clear()
            if self.stopping.is_set():
                break
            started = time.monotonic()
            try:
                self.probe()
            except StoreError as e:
                answered = False
                log.info("etcd did not answer the controller: %s", e)
                continue
            except Exception:  # noqa: BLE001 - the thread must go on: retried next round
                answered = False
                log.exception("store contact failed")
                continue
            now = time.monotonic()
            with self.lock:
                self.observed.reached(now, started, started - waited_from if answered else 0.0)
            answered = True
            with self._answered:
                self.last_ok = now
                self._answered.notify_all()
