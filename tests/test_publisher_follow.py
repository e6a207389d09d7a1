"""A checkpoint server's control thread (checkpoint/publisher.py `Publisher.follow`) against a
real etcd: new plans and discarded steps reach it pushed by watches, and in the steady state
its only request is the lease refresh (it used to read the plan and the discards every second
as well: three requests a second a node)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from conftest import etcd_requests, held_shard, wait_for

from transom.checkpoint import catalog
from transom.checkpoint.publisher import Publisher
from transom.common import keys
from transom.common.records import Plan
from transom.common.states import JobState
from transom.store.etcd_client import REFRESHES_PER_TTL

pytestmark = pytest.mark.timeout(60)


@contextmanager
def following(publisher: Publisher) -> Iterator[threading.Event]:
    """`publisher` started, its control thread following until the block ends (then stopped);
    the event that stops the thread."""
    publisher.start("")
    stopping = threading.Event()
    control = threading.Thread(target=publisher.follow, args=(stopping,), daemon=True)
    control.start()
    try:
        wait_for(lambda: publisher.plan.generation == 1, 10, "the first plan")
        yield stopping
    finally:
        stopping.set()
        control.join(10)
        publisher.stop()
    assert not control.is_alive()


def plan(generation: int, restore_step: int | None = None) -> dict:
    return Plan(
        generation, ["node0", "node1"], JobState.RUNNING, restore_step=restore_step
    ).to_dict()


# A small job's 4 s lease is renewed every second; a large job's long one (the node's TTL) only
# REFRESHES_PER_TTL times a TTL, as the node agent's: every 10 s here, not every second.
@pytest.mark.parametrize("ttl_s", [4, 40])
def test_plans_and_discards_come_pushed_and_the_lease_refresh_is_the_only_steady_request(
    store, ttl_s
):
    store.put(keys.PLAN, plan(1))
    publisher = Publisher(store, "node0", lease_ttl_s=ttl_s)
    discards: list[list[dict]] = []
    publisher.on_discard = discards.append
    with following(publisher) as stopping:
        followers = (publisher.plans, publisher.marks)
        wait_for(lambda: all(f and f.watch.healthy for f in followers), 10, "both watches up")
        window_s = 4.0
        before, started = etcd_requests(store), time.monotonic()
        stopping.wait(window_s)  # a window to count requests in, not a synchronisation
        requests = etcd_requests(store) - before
        refreshes = (time.monotonic() - started) / (ttl_s / REFRESHES_PER_TTL)
        assert requests <= refreshes + 2, f"{requests} requests in {window_s} s"

        store.put(keys.PLAN, plan(2, restore_step=6))
        pushed_at = time.monotonic()
        wait_for(lambda: publisher.plan.generation == 2, 5, "the new plan")
        assert time.monotonic() - pushed_at < 1.0
        assert publisher.plan.restore_step == 6

        marks = [{"first_bad_step": 9, "generation": 2}]
        store.put(keys.CKPT_DISCARDED, marks)
        wait_for(lambda: discards, 5, "the discarded steps")
        expected = [catalog.Discard(first_bad_step=9, generation=2)]
        assert discards == [expected] and publisher.discards == expected


def test_the_steps_retention_removed_are_withdrawn_in_the_listing_batch_without_a_read(store):
    # A lease that outlives the test: nothing renews it here (no `follow`), and the second
    # batch waits for the writer's spacing (batch_writer.SPACING_S).
    publisher = Publisher(store, "node0", lease_ttl_s=60)
    publisher.start("")
    try:
        for rank in (0, 1):
            publisher.list_memory(held_shard(3, rank))
            publisher.list_storage(held_shard(3, rank), f"/ckpt/3/{rank}", {})
        wait_for(lambda: len(catalog.holders(store, 3, 1)) == 2, 10, "step 3 listed")
        writes = publisher.writes
        assert writes is not None
        wait_for(lambda: writes.pending == 0, 10, "step 3's batch sent")
        before = etcd_requests(store)
        publisher.list_storage(held_shard(5, 0), "/ckpt/5/0", {3: [0, 1]})
        wait_for(lambda: writes.pending == 0, 10, "step 5's batch sent")
        assert etcd_requests(store) - before == 1  # one batch: no read of the removed step
        assert catalog.holders(store, 5, 0)
        for rank in (0, 1):  # the storage copies are forgotten, the memory copies stay
            assert list(catalog.holders(store, 3, rank)) == [catalog.memory_holder("node0")]
    finally:
        publisher.stop()


def test_a_recovery_flushes_the_lazy_memory_listings_with_word_of_it(store):
    """Memory listings after a generation's first wait (lazy); a plan in RECOVERING sends them
    at once, with `catalog.Flushed` in the same transaction: once the controller reads that
    word, the catalog holds what the server's memory held."""
    store.put(keys.PLAN, plan(1))
    publisher = Publisher(store, "node0", lease_ttl_s=30)
    with following(publisher) as stopping:
        publisher.list_memory(held_shard(3, 0))  # the generation's first listing: at once
        wait_for(lambda: catalog.holders(store, 3, 0), 5, "step 3 listed")
        publisher.list_memory(held_shard(4, 0))
        publisher.unlist_memory(held_shard(3, 0))
        assert not stopping.wait(1.5)  # a window to see nothing sent in, not a synchronisation
        assert not catalog.holders(store, 4, 0) and catalog.holders(store, 3, 0)
        assert catalog.flushed(store) == {}
        recovering = Plan(1, ["node0", "node1"], JobState.RECOVERING).to_dict()
        store.put(keys.PLAN, recovering)
        wait_for(lambda: catalog.flushed(store) == {"node0": 1}, 5, "the server's word")
        assert catalog.holders(store, 4, 0) and not catalog.holders(store, 3, 0)
