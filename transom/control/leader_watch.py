"""`LeaderWatch`: a standby controller is woken the moment the `leader` key goes away.

The leader key lives under the leader's lease, so its delete is the leader's death (the lease
expired: a SIGKILL, a cut-off host) or its hand-over (it revoked the lease on exit). A standby
waits on this instead of trying to lead every tick; the controller's `StoreContact` still
reads the key every STANDBY_PROBE_S as a safety net (a watch that could not start, or a delete
missed while the stream reconnected, is caught there).

It only reads etcd and only sets the event; it never raises into the caller's thread.
"""

from __future__ import annotations

import logging
import threading

from transom.common import keys
from transom.store import Store, StoreError
from transom.store.watch import PrefixWatch, Update

log = logging.getLogger("transom.controller")

WAIT_S = 0.5  # how long the thread waits for an update before checking for stop


def _leader_gone(update: Update) -> bool:
    if update.snapshot is not None:
        return "" not in update.snapshot
    # The watch is on the name `leader` and so on every key that begins with it: only "" is it.
    return any(e.name == "" and e.deleted for e in update.events)


class LeaderWatch:
    """Sets `wake` whenever the leader key is deleted (or found absent)."""

    def __init__(self, store: Store, wake: threading.Event):
        self.store = store
        self.wake = wake
        self._watch: PrefixWatch | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Follow the key; False if etcd could not be read (try again later)."""
        watch = PrefixWatch(self.store, keys.LEADER)
        try:
            values = watch.start()
        except StoreError as e:
            log.info("cannot watch the leader key yet: %s", e)
            return False
        self._watch = watch
        if "" not in values:
            self.wake.set()
        self._thread = threading.Thread(target=self._follow, name="leader-watch", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stopping.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(WAIT_S * 2)

    def _follow(self) -> None:
        assert self._watch is not None
        while not self._stopping.is_set():
            update = self._watch.get(timeout=WAIT_S)
            if update is not None and _leader_gone(update):
                self.wake.set()
