"""`PrefixMirror`: a local copy of every key under one of a job's names, kept by a watch.

It reads the name's keys once and then applies what a `PrefixWatch` (transom.store.watch)
delivers: puts, deletes, and full re-reads after a compaction. A reader that used to re-read
several prefixes on every poll (the launcher, twice a second) now costs etcd nothing while
nothing changes. The copy is trusted only while the watch is up: while the stream has been down
for key_follow.FALLBACK_AFTER_S, the whole name is read directly, at most every
key_follow.FALLBACK_READ_S, and that read replaces the copy (a change the watch delivers late,
at or before that read's revision, is not applied again).

`take_put()` hands over the names put since it was last called, in revision order, so a
reader can act on each new key once (the launcher appends each new event to events.jsonl);
`forget()` drops names a reader took and needs no more (the launcher its events: the copy stays
the size of the job's state, not of its history, which grows with every save).

It only reads etcd and never interprets values; a direct read that fails raises StoreError to
the caller.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from transom.store.etcd_client import Store
from transom.store.key_follow import Followed
from transom.store.watch import Update

_ABSENT = object()


class PrefixMirror(Followed):
    """Every value under the job's `name`, keyed by the rest of its key."""

    def __init__(self, store: Store, name: str = "") -> None:
        super().__init__(store, name)
        self.values: dict[str, Any] = {}
        self._read_revision = 0  # the revision of the newest direct read (or re-read)
        self._put: list[str] = []

    def take_put(self) -> list[str]:
        """The names put (or found by a re-read) since the last call, oldest first."""
        put, self._put = self._put, []
        return [name for name in dict.fromkeys(put) if name in self.values]

    def forget(self, names: Iterable[str]) -> None:
        """Drop `names` from the copy (a direct read brings back those still in etcd, and
        `take_put` hands them over again)."""
        for name in names:
            self.values.pop(name, None)

    def _take_read(self, values: dict[str, Any], revision: int) -> None:
        self._replace(values, revision)

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
