"""`BatchWriter` (transom/store/batch_writer.py) against a real embedded etcd: a burst of writes
costs etcd one request, writes queued through an etcd stall arrive after it, `close` sends what
is queued."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import etcd_requests, running_etcd, wait_for

from transom.store import Store
from transom.store.batch_writer import BatchWriter

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
