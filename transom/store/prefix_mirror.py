"""`PrefixMirror`: a local copy of every key under one of a job's names, kept by a watch.

It reads the name's keys once and then applies what a `PrefixWatch` (transom.store.watch)
delivers: puts, deletes, and full re-reads after a compaction. A reader that used to re-read
several prefixes on every poll (the launcher, twice a second) now costs etcd nothing while
nothing changes. The copy is trusted only while the watch is up: while the stream has been down
for key_follow.FALLBACK_AFTER_S, the whole name is read directly, at most every
key_follow.FALLBACK_READ_S, and that read replaces the copy (a change the watch delivers late,
at or before that read's revision, is not applied again).

`take_put()` hands over the names put since it was last called, in revision order, so a
reader can act on each new key once (the launcher appends each new event to events.jsonl).

It only reads etcd and never interprets values; a direct read that fails raises StoreError to
the caller.
"""

from __future__ import annotations

import math
from typing import Any

from transom.store.client import Store
from transom.store.key_follow import FALLBACK_AFTER_S, FALLBACK_READ_S
from transom.store.watch import PrefixWatch, Update

_ABSENT = object()


class PrefixMirror:
    """Every value under the job's `name`, keyed by the rest of its key."""

    def __init__(self, store: Store, name: str = "") -> None:
        self.watch = PrefixWatch(store, name)
        self.values: dict[str, Any] = {}
        self.revision = 0  # the newest revision read or applied
        self._read_revision = 0  # the revision of the newest direct read (or re-read)
        self.reads = 0  # direct reads: the first and the fallbacks; the rest came pushed
        self._put: list[str] = []
        self._down_since: float | None = None
        self._read_at = -math.inf

    @property
    def started(self) -> bool:
        return self.reads > 0

    def start(self, now: float) -> None:
        """Read the name's keys and follow them from there (StoreError if etcd cannot be read)."""
        self.read(now)
        self.watch.follow(self.revision)

    def stop(self) -> None:
        self.watch.stop()

    def refresh(self, now: float) -> None:
        """Take in what the watch delivered (or read directly while it is down)."""
        while (update := self.watch.get(timeout=0)) is not None:
            self._apply(update)
        if self.watch.healthy:
            self._down_since = None
        elif self._down_since is None:
            self._down_since = now
        elif now - self._down_since >= FALLBACK_AFTER_S and now - self._read_at >= FALLBACK_READ_S:
            self.read(now)

    def read(self, now: float) -> None:
        """One direct read of every key under the name (StoreError if etcd cannot be read)."""
        self._read_at = now
        values, revision = self.watch.read()
        self.reads += 1
        self._replace(values, revision)

    def take_put(self) -> list[str]:
        """The names put (or found by a re-read) since the last call, oldest first."""
        put, self._put = self._put, []
        return [name for name in dict.fromkeys(put) if name in self.values]

    def _apply(self, update: Update) -> None:
        if update.snapshot is not None:
            self._replace(update.snapshot, update.revision)
        for event in update.events:
            if event.revision <= self._read_revision:
                continue  # a direct read already has it (the watch was behind)
            if event.deleted:
                self.values.pop(event.name, None)
            else:
                self.values[event.name] = event.value
                self._put.append(event.name)
            self.revision = max(self.revision, event.revision)

    def _replace(self, values: dict[str, Any], revision: int) -> None:
        if revision < self.revision:
            return  # older than what was applied already
        self._put.extend(n for n, v in values.items() if self.values.get(n, _ABSENT) != v)
        self.values = dict(values)
        self.revision = self._read_revision = revision
