"""`PlanFollower`: the job's plan as a node agent knows it, pushed to it by an etcd watch.

An agent used to read the plan every tick: five requests a second a node, to learn of the few
plans a job ever has. It now reads the `plan` key once and then follows it through a
`PrefixWatch` (transom.store.watch): etcd pushes each new plan, and `wait` returns as soon as
one arrives, so the agent acts on a plan at once instead of at its next poll. The watch is
trusted only while it is up:
  - while its stream has been down for FALLBACK_AFTER_S (etcd restarting, a network cut, a
    stream that cannot reconnect), the plan is read directly, at most every FALLBACK_READ_S:
    a broken stream costs at most what polling cost, and no plan is missed;
  - `resync()` (after an outage, and before the agent takes a lost lease again, when an eviction
    must not be missed) reads the plan now and makes the stream reconnect: a network cut can
    leave a stream's TCP connection open and silent, never to deliver again.
A plan read directly and one the watch delivers are ordered by the etcd revision each was read
or written at, so an older plan never replaces a newer one.

It only reads etcd; a direct read that fails raises StoreError to the caller (an outage).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from transom.common import keys
from transom.common.records import Plan, RecordError
from transom.store import Store
from transom.store.watch import PrefixWatch, Update

log = logging.getLogger("transom.agent")

# The watch reconnects within 2 s at most (watch.BACKOFF_S); a stream down longer than this is
# not just reconnecting, and the plan is read directly until it is back.
FALLBACK_AFTER_S = 1.0
FALLBACK_READ_S = 1.0


class PlanFollower:
    def __init__(self, store: Store) -> None:
        self.watch = PrefixWatch(store, keys.PLAN)
        self.value: Any | None = None  # the newest plan's stored value (None: no plan yet)
        self.revision = 0  # the etcd revision it was read or written at
        self.reads = 0  # direct reads (the first, fallbacks and resyncs); the rest came pushed
        self._down_since: float | None = None
        self._read_at = -math.inf
        self._parsed: tuple[int, Plan | None] = (-1, None)  # (revision, its plan)

    def start(self, now: float) -> None:
        """Read the plan and follow it from there (StoreError if etcd cannot be read)."""
        self.read(now)
        self.watch.follow(self.revision)

    def stop(self) -> None:
        self.watch.stop()

    def wait(self, timeout: float) -> None:
        """Return when a new plan arrives or after `timeout` seconds."""
        update = self.watch.get(timeout=timeout)
        if update is not None:
            self._apply(update)

    def current(self, now: float) -> Plan | None:
        """The newest plan known (None: none yet, or an invalid one, logged once)."""
        while (update := self.watch.get(timeout=0)) is not None:
            self._apply(update)
        if self.watch.healthy:
            self._down_since = None
        elif self._down_since is None:
            self._down_since = now
        elif now - self._down_since >= FALLBACK_AFTER_S and now - self._read_at >= FALLBACK_READ_S:
            self.read(now)
        return self._plan()

    def resync(self, now: float) -> None:
        """Read the plan now, and make the stream reconnect (StoreError if etcd cannot be read)."""
        self.watch.reconnect()
        self.read(now)

    def read(self, now: float) -> None:
        """One direct read of the plan (StoreError if etcd cannot be read)."""
        self._read_at = now
        values, revision = self.watch.read()
        self.reads += 1
        self._take(values.get(""), revision)

    def _apply(self, update: Update) -> None:
        if update.snapshot is not None:
            self._take(update.snapshot.get(""), update.revision)
        for event in update.events:
            if event.name == "":
                self._take(None if event.deleted else event.value, event.revision)

    def _take(self, value: Any | None, revision: int) -> None:
        if revision > self.revision:
            self.value, self.revision = value, revision

    def _plan(self) -> Plan | None:
        revision, plan = self._parsed
        if revision != self.revision:
            plan = None
            if self.value is not None:
                try:
                    plan = Plan.from_dict(self.value)
                except RecordError as e:
                    log.warning("ignoring an invalid plan: %s", e)
            self._parsed = (self.revision, plan)
        return plan
