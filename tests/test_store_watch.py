"""`PrefixWatch` (transom/store/watch.py) against a real embedded etcd: changes arrive in order
and once, a compaction turns into a full re-read, an etcd restart mid-watch loses nothing."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from conftest import wait_for

from transom.store import EmbeddedEtcd, Store
from transom.store.watch import PrefixWatch, Update, WatchEvent

pytestmark = pytest.mark.timeout(60)


def events(watch: PrefixWatch, count: int, timeout: float = 20.0) -> list[WatchEvent]:
    """The next `count` events (fails the test if they do not come in `timeout`)."""
    out: list[WatchEvent] = []
    deadline = time.monotonic() + timeout
    while len(out) < count:
        update = watch.get(timeout=max(0.0, deadline - time.monotonic()))
        assert update is not None, f"only {len(out)} of {count} events came: {out}"
        assert update.snapshot is None
        out.extend(update.events)
    return out


def test_start_returns_the_values_then_changes_arrive_in_order(store):
    store.put("nodes/a", {"n": 0})
    store.put("nodesX", "not under nodes/")
    with PrefixWatch(store, "nodes/") as watch:
        assert watch.start() == {"a": {"n": 0}}
        store.put("nodes/a", {"n": 1})
        store.put("other/b", 1)
        store.put("nodes/b", [1, 2])
        store.delete("nodes/a")
        store.put("nodesY", "not under nodes/ either")
        store.client.put(store.key("nodes/c"), "not json")
        seen = events(watch, 4)
        assert [(e.name, e.deleted, e.value) for e in seen] == [
            ("a", False, {"n": 1}),
            ("b", False, [1, 2]),
            ("a", True, None),
            ("c", False, None),
        ]
        revisions = [e.revision for e in seen]
        assert revisions == sorted(set(revisions))
        assert watch.get(timeout=0.3) is None  # nothing else, nothing twice
        assert watch.healthy


def test_a_transaction_arrives_as_one_update(store):
    store.put("leader", "me")
    with PrefixWatch(store, "") as watch:
        watch.start()
        assert store.put_if_leader("me", {"plan": 1, "state": "RUNNING"})
        update = watch.get(timeout=10)
        assert isinstance(update, Update)
        assert {e.name: e.value for e in update.events} == {"plan": 1, "state": "RUNNING"}
        assert len({e.revision for e in update.events}) == 1 == len({update.revision})


def test_on_update_is_called_from_the_watch_thread_and_a_failing_call_ends_nothing(store):
    taken: queue.Queue[tuple[str, Update]] = queue.Queue()

    def take(update: Update) -> None:
        taken.put((threading.current_thread().name, update))
        if any(e.value == "boom" for e in update.events):
            raise RuntimeError("the caller's bug")

    store.put("nodes/z", 0)
    with PrefixWatch(store, "nodes/", on_update=take) as watch:
        assert watch.start() == {"z": 0}
        # the first read first, in the caller's thread: no change can be applied before it
        thread, first = taken.get(timeout=0)
        assert thread == threading.current_thread().name and first.snapshot == {"z": 0}
        store.put("nodes/a", "boom")
        seen = [taken.get(timeout=20)]  # the call that raised
        store.put("nodes/a", 1)
        store.put("nodes/a", 2)  # may come in the same update as 1
        while sum(len(u.events) for _, u in seen) < 3:
            seen.append(taken.get(timeout=20))
        assert [e.value for _, u in seen for e in u.events] == ["boom", 1, 2]
        assert {thread for thread, _ in seen} == {"watch-nodes/"}
        assert watch.get(timeout=0.3) is None  # nothing queued besides
        assert watch.healthy and watch.reconnects == 0


def test_a_slow_caller_loses_nothing(store):
    with PrefixWatch(store, "s/", queue_size=2) as watch:
        watch.start()
        for i in range(12):
            store.put(f"s/{i}", i)
        assert [e.value for e in events(watch, 12)] == list(range(12))


def test_wake_ends_a_wait_at_once_and_hides_no_update_behind_it(store):
    with PrefixWatch(store, "w/") as watch:
        watch.start()
        threading.Timer(0.2, watch.wake).start()
        started = time.monotonic()
        assert watch.get(timeout=30) is None  # woken, not timed out
        assert time.monotonic() - started < 10
        watch.wake()  # a wake queued before an update: a get that finds both takes the update
        store.put("w/a", 1)
        wait_for(lambda: watch.updates.qsize() == 2, 20, "the update queued behind the wake")
        update = watch.get(timeout=0)
        assert update is not None and [e.value for e in update.events] == [1]


def test_a_compacted_revision_gives_a_full_re_read(store):
    store.put("c/x", 1)
    _, old = PrefixWatch(store, "c/").read()
    store.put("c/x", 2)
    store.put("c/y", 3)
    _, now = PrefixWatch(store, "c/").read()
    store.client.post(store.client.get_url("/kv/compaction"), json={"revision": now})
    with PrefixWatch(store, "c/") as watch:
        watch.follow(old)
        update = watch.get(timeout=10)
        assert update is not None and update.snapshot == {"x": 2, "y": 3}
        assert update.revision >= now and not update.events
        store.put("c/z", 4)
        assert [(e.name, e.value) for e in events(watch, 1)] == [("z", 4)]


@pytest.mark.integration
def test_an_etcd_restart_mid_watch_loses_and_repeats_nothing(tmp_path):
    server = EmbeddedEtcd(tmp_path / "etcd")
    try:
        server.start()
        store = Store(server.access, "restart")
        with PrefixWatch(store, "k/") as watch:
            watch.start()
            for i in range(5):
                store.put(f"k/{i}", i)
            first = events(watch, 5)
            server.stop()
            deadline = time.monotonic() + 10
            while watch.healthy and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not watch.healthy
            server.start()  # same data, same ports
            store = Store(server.access, "restart")  # the restart wrote new certificates
            for i in range(5, 10):  # written before the watch is back (or while it comes back)
                store.put(f"k/{i}", i)
            rest = events(watch, 5)
            assert [e.value for e in first + rest] == list(range(10))
            assert watch.get(timeout=0.5) is None
            assert watch.reconnects >= 1
            stopped = time.monotonic()
        assert time.monotonic() - stopped < 2.0
        assert not watch._thread.is_alive()
    finally:
        server.stop()


@pytest.mark.integration
def test_stop_is_prompt_while_etcd_is_down(tmp_path):
    server = EmbeddedEtcd(tmp_path / "etcd")
    try:
        server.start()
        watch = PrefixWatch(Store(server.access, "down"), "k/")
        watch.start()
        server.stop()
        time.sleep(0.5)  # let it fail and back off
        started = time.monotonic()
        watch.stop()
        assert time.monotonic() - started < 2.0
        assert not watch._thread.is_alive()
    finally:
        server.stop()
