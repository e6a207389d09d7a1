"""`BatchWriter` (transom/store/batch_writer.py) against a real embedded etcd: a burst of writes
costs etcd one request, writes that trickle in cost one request a SPACING_S at most, an urgent
write (or `hurry`) does not wait for the spacing, a lazy write waits for a send to go with (or
LAZY_S) and `flush` sends at once, a delete of a put never sent cancels it, the last
write of a name wins, writes queued through an etcd stall arrive after it, a put under a lease
etcd no longer has is dropped and the rest still sent, `close` sends what is queued."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import etcd_requests, running_etcd, wait_for

from transom.store import Store, batch_writer
from transom.store.batch_writer import LINGER_S, SPACING_S, BatchWriter

pytestmark = pytest.mark.timeout(60)


def test_a_burst_of_writes_is_one_request(store):
    writer = BatchWriter(store)
    try:
        before = etcd_requests(store)
        for i in range(50):
            writer.put(f"events/{i:03d}", {"i": i})
        wait_for(lambda: writer.sends and not writer.pending, 10, "the burst sent")
        assert writer.sends == 1
        assert etcd_requests(store) - before == 1  # one transaction for the 50
        assert store.get_prefix("events/")["007"] == {"i": 7}
    finally:
        writer.close()


def test_writes_that_trickle_in_are_sent_once_a_spacing_at_most(store):
    writer = BatchWriter(store)
    paced = threading.Event()
    try:
        began = time.monotonic()
        for i in range(10):  # one write every SPACING_S / 5, over 2 SPACING_S
            writer.put(f"events/{i:02d}", i)
            paced.wait(SPACING_S / 5)
        took = time.monotonic() - began
        wait_for(lambda: not writer.pending, SPACING_S + 5, "every write sent")
        assert writer.sends <= took / SPACING_S + 1  # not one a LINGER_S (10 with 0.2 s)
        assert store.get_prefix("events/") == {f"{i:02d}": i for i in range(10)}
    finally:
        writer.close()


def test_an_urgent_write_does_not_wait_for_the_spacing(store):
    writer = BatchWriter(store)
    try:
        writer.put("events/first", 1)
        wait_for(lambda: writer.sends == 1, 5, "the first write sent")
        writer.put("events/paced", 2)  # waits for SPACING_S after the first send
        writer.put("ckpt/listing", 3, urgent=True)  # takes the paced one along
        began = time.monotonic()
        wait_for(lambda: store.get("ckpt/listing") == 3, SPACING_S, "the urgent write sent")
        assert time.monotonic() - began < SPACING_S / 2, "it waited for the spacing"
        assert store.get("events/paced") == 2 and writer.sends == 2
        writer.put("events/later", 4)
        writer.hurry()
        wait_for(lambda: writer.sends == 3, SPACING_S / 2, "a hurried send")
        assert store.get("events/later") == 4
    finally:
        writer.close()


def test_a_lazy_write_goes_with_the_next_send_or_after_lazy_s(store, monkeypatch):
    """Memory listings of snapshots are lazy: alone they wait LAZY_S; another write, a flush
    or LAZY_S takes them along."""
    monkeypatch.setattr(batch_writer, "LAZY_S", 3.0)
    writer = BatchWriter(store)
    try:
        writer.put("ckpt/a", 1, lazy=True)
        writer.delete("ckpt/gone", lazy=True)
        quiet = threading.Event()
        assert not quiet.wait(1.0) and writer.sends == 0  # nothing sent for it alone
        writer.put("events/e", 2)  # a write that starts a send takes the lazy ones along
        wait_for(lambda: writer.sends == 1 and not writer.pending, 5, "the send")
        assert store.get("ckpt/a") == 1 and store.get("events/e") == 2
        writer.put("ckpt/b", 3, lazy=True)
        began = time.monotonic()
        wait_for(lambda: store.get("ckpt/b") == 3, 10, "the lazy write, alone, after LAZY_S")
        assert time.monotonic() - began >= 3.0 - 0.1
        writer.put("ckpt/c", 4, lazy=True)
        writer.flush()  # at once: no LAZY_S, no SPACING_S, no LINGER_S
        began = time.monotonic()
        wait_for(lambda: store.get("ckpt/c") == 4, 5, "the flushed write")
        assert time.monotonic() - began < LINGER_S
    finally:
        writer.close()


def test_a_delete_of_a_put_never_sent_cancels_it_and_one_sent_is_deleted(store):
    writer = BatchWriter(store)
    try:
        writer.put("ckpt/kept", 1)
        wait_for(lambda: store.get("ckpt/kept") == 1, 5, "the first put")
        writer.put("ckpt/brief", 2, lazy=True)
        writer.delete("ckpt/brief", lazy=True)  # listed and evicted between two sends
        assert writer.pending == 0  # neither goes
        store.put("ckpt/brief", "someone else's")  # a name this writer never sent
        writer.delete("ckpt/brief")
        writer.delete("ckpt/kept")
        wait_for(lambda: writer.pending == 0, 5, "the deletes sent")
        assert store.get("ckpt/brief") is None and store.get("ckpt/kept") is None
    finally:
        writer.close()


@pytest.mark.integration
def test_writes_queued_through_a_stall_arrive_after_it(tmp_path):
    with running_etcd(tmp_path / "etcd") as server:
        store = Store(server.access, "stall")
        writer = BatchWriter(store)
        try:
            assert server.process is not None
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                writer.put("events/a", 1)
                writer.put("events/b", 2)
                wait_for(lambda: writer.failures > 0, 20, "a send that fails during the stall")
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            wait_for(lambda: store.get_prefix("events/") == {"a": 1, "b": 2}, 20, "both writes")
        finally:
            writer.close()


def test_close_sends_what_is_queued(store):
    writer = BatchWriter(store)
    writer.put("events/last", "x")
    writer.close()
    assert store.get("events/last") == "x"


def test_puts_and_deletes_go_together_and_the_last_write_of_a_name_wins(store):
    store.put("ckpt/old", 1)
    writer = BatchWriter(store)
    try:
        before = etcd_requests(store)
        writer.put("ckpt/a", 1)
        writer.delete("ckpt/a")  # listed, then evicted before the batch went: deleted
        writer.delete("ckpt/b")
        writer.put("ckpt/b", 2)  # withdrawn, then listed again: listed
        writer.delete("ckpt/old")
        wait_for(lambda: writer.sends and not writer.pending, 10, "the batch sent")
        assert writer.sends == 1 and etcd_requests(store) - before == 1
        assert store.get_prefix("ckpt/") == {"b": 2}
    finally:
        writer.close()


def test_a_put_under_a_dead_lease_is_dropped_and_the_rest_sent(store):
    dead, live = store.lease(10), store.lease(10)
    store.revoke(dead)
    writer = BatchWriter(store, live_lease=lambda: live)
    try:
        writer.put("ckpt/dead", 1, lease=dead)
        writer.put("ckpt/live", 2, lease=live)
        writer.put("events/e", 3)
        wait_for(lambda: not writer.pending, 10, "the batch sent")
        assert writer.dead_lease_drops == 1
        assert store.get_prefix("ckpt/") == {"live": 2} and store.get("events/e") == 3
    finally:
        writer.close()
        store.revoke(live)
