"""`PrefixMirror` (transom/store/prefix_mirror.py) against a real embedded etcd: the copy follows
puts and deletes without reading again, hands each new name over once, and a direct read while
the stream is down is not undone by changes the watch delivers late."""

from __future__ import annotations

import time

import pytest

from transom.store.prefix_mirror import PrefixMirror
from transom.store.watch import Update, WatchEvent

pytestmark = pytest.mark.timeout(60)


def settle(mirror: PrefixMirror, expected: dict, timeout: float = 20.0) -> None:
    """Refresh until the copy equals `expected` (fails the test if it does not in `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        mirror.refresh(time.monotonic())
        if mirror.values == expected:
            return
        assert time.monotonic() < deadline, f"copy {mirror.values} never became {expected}"
        time.sleep(0.05)


def test_the_copy_follows_puts_and_deletes_through_the_watch(store):
    store.put("status/a", {"n": 0})
    mirror = PrefixMirror(store)
    try:
        mirror.start(time.monotonic())
        assert mirror.values == {"status/a": {"n": 0}}
        assert mirror.take_put() == ["status/a"]
        store.put("status/a", {"n": 1})
        store.put("events/1", {"e": 1})
        store.delete("status/a")
        store.put("events/2", {"e": 2})
        settle(mirror, {"events/1": {"e": 1}, "events/2": {"e": 2}})
        assert mirror.take_put() == ["events/1", "events/2"]  # the deleted name is not handed
        assert mirror.take_put() == []  # once only
        assert mirror.reads == 1  # everything after the first read came pushed
    finally:
        mirror.stop()


def test_a_late_delivery_does_not_undo_a_newer_direct_read(store):
    store.put("job", {"state": "RUNNING"})
    mirror = PrefixMirror(store)
    try:
        mirror.read(time.monotonic())  # not following: deliveries are handed in by hand
        old = mirror.revision
        store.put("job", {"state": "SUCCEEDED"})
        mirror.read(time.monotonic())
        late = WatchEvent(name="job", deleted=False, value={"state": "RUNNING"}, revision=old)
        mirror._apply(Update(revision=old, events=(late,)))
        assert mirror.values["job"] == {"state": "SUCCEEDED"}
        newer = WatchEvent(name="job", deleted=True, value=None, revision=mirror.revision + 1)
        mirror._apply(Update(revision=newer.revision, events=(newer,)))
        assert "job" not in mirror.values
    finally:
        mirror.stop()


def test_while_the_stream_is_down_the_name_is_read_directly(store, monkeypatch):
    store.put("nodes/a", 1)
    mirror = PrefixMirror(store)
    try:
        mirror.start(time.monotonic())
        deadline = time.monotonic() + 20
        while not mirror.watch.healthy:  # the stream is up (it sets healthy only when it is)
            assert time.monotonic() < deadline, "the watch never came up"
            time.sleep(0.05)
        monkeypatch.setattr(mirror.watch, "healthy", False)  # as while it reconnects
        store.put("nodes/b", 2)
        now = time.monotonic()
        mirror.refresh(now)  # the outage begins: not read yet
        mirror.refresh(now + 5)
        assert mirror.reads == 2
        assert mirror.values == {"nodes/a": 1, "nodes/b": 2}
    finally:
        mirror.stop()
