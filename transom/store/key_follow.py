"""`KeyFollower`: one etcd key's newest value, pushed by a watch instead of polled.

It reads the key once and then follows it through a `PrefixWatch` (transom.store.watch): etcd
pushes each new value, and `wait` returns as soon as one arrives. The watch is trusted only
while it is up:
  - while its stream has been down for FALLBACK_AFTER_S (etcd restarting, a network cut, a
    stream that cannot reconnect), the key is read directly, at most every FALLBACK_READ_S: a
    broken stream costs at most what polling once a second cost, and no value is missed;
  - `resync()` reads the key now and makes the stream reconnect: a network cut can leave a
    stream's TCP connection open and silent, never to deliver again.
A value read directly and one the watch delivers are ordered by the etcd revision each was
read or written at, so an older value never replaces a newer one.

`Followed` is what it shares with store/prefix_mirror.py (a whole name's keys): draining the
watch and the direct reads while it is down. It only reads etcd and never interprets the value
(its users parse it); a direct read that fails raises StoreError to the caller.
"""

from __future__ import annotations

import math
from typing import Any

from transom.store.etcd_client import Store
from transom.store.watch import PrefixWatch, Update

# The watch reconnects within 2 s at most (watch.BACKOFF_S); a stream down longer than this is
# not just reconnecting, and the key is read directly until it is back.
FALLBACK_AFTER_S = 1.0
FALLBACK_READ_S = 1.0


class Followed:
    """What a follower of a name's keys shares: the watch, drained by `refresh`, and direct
    reads while the watch is down (subclasses say what an update and a read mean to them)."""

    def __init__(self, store: Store, name: str) -> None:
        self.watch = PrefixWatch(store, name)
        self.revision = 0  # the etcd revision of the newest value read or applied
        self.reads = 0  # direct reads (the first, fallbacks and resyncs); the rest came pushed
        self._down_since: float | None = None
        self.read_at = -math.inf  # when the newest direct read was made
        self.heard_at = -math.inf  # when etcd was last heard: a direct read, or a watch update

    def start(self, now: float) -> None:
        """Read the name and follow it from there (StoreError if etcd cannot be read)."""
        self.read(now)
        self.watch.follow(self.revision)

    @property
    def started(self) -> bool:
        return self.reads > 0

    def start_once(self, now: float) -> None:
        """`start`, unless it succeeded before (a first read that failed is tried again)."""
        if not self.started:
            self.start(now)

    def stop(self) -> None:
        self.watch.stop()

    def refresh(self, now: float) -> None:
        """Take in what the watch delivered (or read directly while it is down)."""
        while (update := self.watch.get(timeout=0)) is not None:
            self._apply(update)
            self.heard_at = now
        if self.watch.healthy:
            self._down_since = None
        elif self._down_since is None:
            self._down_since = now
        elif now - self._down_since >= FALLBACK_AFTER_S and now - self.read_at >= FALLBACK_READ_S:
            self.read(now)

    def read(self, now: float) -> None:
        """One direct read of the name (StoreError if etcd cannot be read)."""
        self.read_at = now
        values, revision = self.watch.read()
        self.reads += 1
        self.heard_at = now
        self._take_read(values, revision)

    def _apply(self, update: Update) -> None:
        raise NotImplementedError

    def _take_read(self, values: dict[str, Any], revision: int) -> None:
        raise NotImplementedError


class KeyFollower(Followed):
    """The newest value of the job's key `name` (None: absent or deleted)."""

    def __init__(self, store: Store, name: str) -> None:
        super().__init__(store, name)
        self.value: Any | None = None

    def wait(self, timeout: float) -> None:
        """Return when a new value arrives or after `timeout` seconds."""
        update = self.watch.get(timeout=timeout)
        if update is not None:
            self._apply(update)

    def wake(self) -> None:
        """Make a `wait` under way (or the next) return at once; from any thread."""
        self.watch.wake()

    def refresh(self, now: float) -> Any | None:
        """Take in what the watch delivered (or read directly while it is down); the value."""
        super().refresh(now)
        return self.value

    def resync(self, now: float) -> None:
        """Read the key now, and make the stream reconnect (StoreError if etcd cannot be read)."""
        self.watch.reconnect()
        self.read(now)

    def _take_read(self, values: dict[str, Any], revision: int) -> None:
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
