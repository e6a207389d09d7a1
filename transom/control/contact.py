"""`StoreContact`: a controller's one steady store call, which also measures its gaps to etcd.

With watches the controller's ticks no longer read etcd, so they can no longer tell by
themselves that etcd stalled (a paused etcd keeps a watch stream open and silent). One thread
makes one small call every PROBE_S instead: the leader refreshes its leadership lease (the
keep-alive it needs anyway), a standby reads the leader key (and wakes its loop when the key
is gone: a safety net under the leader-key watch). Each success is recorded in `Observed` with
the time the thread waited by choice left out, so a gap is a stretch in which calls failed or
stalled, not the prober's own pauses.

The controller asks it two things before it acts on its watched view:
  - `stale(now)`: no call succeeded for longer than STALE_S (etcd may be paused or down):
    the view may be silently old; do not act on it;
  - `answered_since(t)`: a call succeeded after `t`; a lease expiry the view saw at `t` may be
    etcd's own (it revokes every expired lease on resuming from a stall), so the controller
    acts on it only once this call has recorded any gap that preceded it (`kick` asks for one
    at once, and `wake` is set when it answers).

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

log = logging.getLogger("transom.controller")

PROBE_S = 0.5  # one call this often (the leader's lease TTL is 3 s: six refreshes per TTL)
STALE_S = MIN_GAP_S  # without an answer this long, what the watches show may be old


class StoreContact:
    """Runs `probe` (a store call; StoreError when etcd did not answer) every PROBE_S."""

    def __init__(
        self,
        probe: Callable[[], None],
        observed: Observed,
        stopping: threading.Event,
        wake: threading.Event,
    ):
        self.probe = probe
        self.observed = observed
        self.lock = threading.Lock()  # guards `observed`
        self.stopping = stopping
        self.wake = wake
        self.last_ok: float | None = None  # monotonic time of the newest success
        self._kick = threading.Event()
        self._wake_on_answer = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="store-contact", daemon=True)
            self._thread.start()

    def kick(self) -> None:
        """Call now (not at the next round) and set `wake` when it answers."""
        self._wake_on_answer = True
        self._kick.set()

    def stale(self, now: float) -> bool:
        return self.last_ok is None or now - self.last_ok > STALE_S

    def answered_since(self, t: float) -> bool:
        return self.last_ok is not None and self.last_ok >= t

    def _run(self) -> None:
        answered = False  # the previous round succeeded (so the wait before this one was idle)
        while not self.stopping.is_set():
            waited_from = time.monotonic()
            if self._kick.wait(PROBE_S):
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
            self.last_ok, answered = now, True
            if self._wake_on_answer:
                self._wake_on_answer = False
                self.wake.set()
