"""One lease a node (checkpoint/agent_lease.py, publisher.py): a node agent's checkpoint server
lists its peer address and its memory's shards under the agent's lease, handed over on its stdin,
renews none of its own, lists everything again under each new lease, withdraws its listings
when it stops (the agent's lease lives on), and a server that replaces a dead one first
withdraws what that one listed. The lines on the pipe are checked like anything that crosses a
process boundary."""

from __future__ import annotations

import io
import threading

import pytest
from conftest import etcd_requests, held_shard, wait_for

from transom.checkpoint import agent_lease, catalog
from transom.checkpoint.publisher import Publisher
from transom.common import keys
from transom.common.states import Tier
from transom.store import Store

pytestmark = pytest.mark.timeout(60)

ADDR = "127.0.0.1:7000"
MEMORY = catalog.memory_holder("node0")


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b"42\n", 42),
        (b" 7 \n", 7),
        (b"0\n", None),
        (b"-3\n", None),
        (b"12a\n", None),
        (b"\n", None),
        (b"%d\n" % 2**63, None),
        (b"1" * 40 + b"\n", None),
    ],
)
def test_only_a_positive_int64_is_a_lease_id(raw: bytes, expected: int | None):
    assert agent_lease.parse(raw) == expected


def test_the_reader_adopts_valid_lines_only_and_skips_an_overlong_line_whole():
    stream = io.BytesIO(
        agent_lease.line(5) + b"junk\n" + b"9" * 40 + b"123\n" + agent_lease.line(6) + b"77"
    )
    adopted: list[int] = []
    agent_lease.follow(stream, adopted.append).join(5)
    # The tail of the overlong line (123) is no lease, nor the unfinished last line.
    assert adopted == [5, 6]


def _lease_of(store: Store, name: str) -> int | None:
    """The lease etcd holds `name` under (0: none), None when it is absent."""
    found = store.client.get(store.key(name), metadata=True)
    return int(found[0][1].get("lease", 0)) if found else None


def _follow(publisher: Publisher) -> tuple[threading.Event, threading.Thread]:
    stopping = threading.Event()
    control = threading.Thread(target=publisher.follow, args=(stopping,), daemon=True)
    control.start()
    return stopping, control


def test_a_server_lists_under_each_lease_the_agent_hands_over_and_renews_none(store):
    held = [held_shard(3, 0)]
    publisher = Publisher(store, "node0", lease_ttl_s=None)
    publisher.held = lambda: held
    publisher.start(ADDR)
    stopping, control = _follow(publisher)
    first, second = store.lease(30), store.lease(30)
    shard_name = keys.ckpt_shard(3, 0, MEMORY)
    try:
        publisher.list_memory(held[0])  # before any lease: not listed (it would outlive the node)
        assert publisher.lease is None
        publisher.adopt(first.id)
        wait_for(lambda: _lease_of(store, shard_name) == first.id, 10, "listed under the lease")
        assert _lease_of(store, keys.ckpt_server("node0")) == first.id
        writes = publisher.writes
        assert writes is not None
        wait_for(lambda: writes.pending == 0, 10, "the listing sent")

        window_s = 3.0
        before = etcd_requests(store)
        stopping.wait(window_s)  # a window to count requests in, not a synchronisation
        assert etcd_requests(store) - before == 0  # no lease of its own to renew

        publisher.adopt(second.id)  # the agent's lease expired in an outage: a new one
        wait_for(lambda: _lease_of(store, shard_name) == second.id, 10, "listed again")
        store.revoke(first)
        assert _lease_of(store, keys.ckpt_server("node0")) == second.id
        assert _lease_of(store, shard_name) == second.id
    finally:
        stopping.set()
        control.join(10)
        publisher.stop()
    # Stopped: its registration and listings are withdrawn, the agent's lease is not revoked.
    assert _lease_of(store, keys.ckpt_server("node0")) is None
    assert _lease_of(store, shard_name) is None
    assert store.refresh(second)
    store.revoke(second)


def test_a_server_replacing_a_dead_one_withdraws_its_memory_listings_first(store):
    lease = store.lease(30)
    for rank in (0, 1):  # the dead server's, under the agent's lease that lives on
        catalog.publish(store, MEMORY, catalog.Listing(3, rank, Tier.MEMORY, node="node0"), lease)
    catalog.publish(
        store, catalog.memory_holder("node1"), catalog.Listing(3, 0, Tier.MEMORY), lease
    )
    catalog.publish(store, catalog.STORAGE_HOLDER, catalog.Listing(3, 0, Tier.STORAGE))
    held = [held_shard(5, 0)]  # what the new server took in before the lease came
    publisher = Publisher(store, "node0", lease_ttl_s=None)
    publisher.held = lambda: held
    publisher.withdraw_stale = True
    publisher.start(ADDR)
    stopping, control = _follow(publisher)
    try:
        publisher.adopt(lease.id)
        wait_for(lambda: catalog.holders(store, 5, 0), 10, "the new server's shard listed")
        assert set(catalog.holders(store, 3, 0)) == {
            catalog.memory_holder("node1"),
            catalog.STORAGE_HOLDER,
        }
        assert catalog.holders(store, 3, 1) == {}
        assert list(catalog.holders(store, 5, 0)) == [MEMORY]
    finally:
        stopping.set()
        control.join(10)
        publisher.stop()
        store.revoke(lease)


def test_a_server_on_its_own_registers_under_a_lease_of_its_own_and_revokes_it_on_stop(store):
    publisher = Publisher(store, "node0", lease_ttl_s=4)  # its renewals: test_publisher_follow
    publisher.start(ADDR)
    lease = publisher.lease
    try:
        assert _lease_of(store, keys.ckpt_server("node0")) == lease.id
    finally:
        publisher.stop()
    assert _lease_of(store, keys.ckpt_server("node0")) is None
    assert not store.refresh(lease)
