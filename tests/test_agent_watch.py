"""The node agent's side of an event-driven control plane (issue 14), against a real etcd.

- The plan reaches an agent through its watch: no read per tick (etcd's own request counter says
  so), and a plan the stream missed while the node was cut off is read on `resync`; a stream
  that stays down is replaced by direct reads.
- The lease keeper's renewals are the agent's evidence that etcd answers (its `NodeContact`):
  a node cut off from etcd (a blackholed proxy in front of it) enters an outage and its time cut
  off grows towards the TTL (the fence rule's input), and it leaves the outage when etcd answers
  again.
- Status and summaries are written when they change or at their heartbeat, and the heartbeat
  keeps the controller's extrapolated view of a rank true (no false stopped heartbeat, no
  false hang, no telemetry gap).
"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import etcd_requests, etcd_requests_by_method, wait_for

from transom.common import keys
from transom.common.records import (
    Anomaly,
    FailureKind,
    FailureReport,
    MasterAddress,
    MonitorSummary,
    Plan,
    RankSummary,
    Severity,
    SummaryRequest,
)
from transom.common.states import JobState, NodeState
from transom.control import agent as agent_module
from transom.control import node_reports
from transom.control.agent import NodeAgent
from transom.control.lease_keeper import LeaseKeeper
from transom.control.monitor_rules import SUMMARY_GAP_S
from transom.control.plan_follow import PlanFollower
from transom.faults import MockNvml
from transom.job_spec import JobSpec
from transom.monitor import detectors
from transom.monitor.detectors import HEARTBEAT_GAP_S
from transom.monitor.node import NodeMonitor
from transom.store import Store, StoreAccess, key_follow
from transom.testing.store_proxy import StoreProxy

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def proxied(etcd, store):
    """(a store reaching etcd through a proxy the test can blackhole, the proxy)."""
    proxy = StoreProxy(etcd.access.host, etcd.access.port, "agent")
    access = StoreAccess(proxy.url, etcd.access.ca, etcd.access.cert, etcd.access.key)
    try:
        yield Store(access, store.job_id), proxy
    finally:
        proxy.close()


def plan(generation: int, **fields) -> dict:
    return Plan(generation, ["node0", "node1"], JobState.RUNNING, **fields).to_dict()


def follow_until(follower: PlanFollower, generation: int, timeout: float) -> float:
    """Seconds until the follower knows `generation` (waiting as the agent's loop does)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        current = follower.current(time.monotonic())
        if current is not None and current.generation == generation:
            return time.monotonic() - started
        follower.wait(0.2)
    raise AssertionError(f"generation {generation} did not reach the follower in {timeout} s")


# -- the plan, followed -------------------------------------------------------------------------


def test_a_new_plan_reaches_the_agent_through_its_watch_without_polling(store):
    store.put(keys.PLAN, plan(1))
    follower = PlanFollower(store)
    try:
        follower.start(time.monotonic())
        assert follower.current(time.monotonic()).generation == 1
        wait_for(lambda: follower.watch.healthy, 10, "the watch stream to be up")
        before = etcd_requests(store)
        deadline = time.monotonic() + 2.0  # ten ticks of the old polling agent
        while time.monotonic() < deadline:
            follower.current(time.monotonic())
            follower.wait(agent_module.TICK_S)
        assert etcd_requests(store) - before < 2  # no read a tick: nothing at all
        store.put(keys.PLAN, plan(2, restart_count=1))
        assert follow_until(follower, 2, 10) < 1.0  # pushed: the waiting loop wakes at once
        assert follower.reads == 1  # only the first read; the new plan came pushed
    finally:
        follower.stop()


def test_the_master_address_reaches_the_other_members_on_the_plan_watch_without_a_read(store):
    store.put(keys.PLAN, plan(1))
    store.put(keys.master(1), MasterAddress("10.0.0.1", 29500).to_dict())  # there before start
    follower = PlanFollower(store)
    try:
        follower.start(time.monotonic())
        assert follower.master(1) == MasterAddress("10.0.0.1", 29500)
        wait_for(lambda: follower.watch.healthy, 10, "the watch stream to be up")
        store.put(keys.PLAN, plan(2, restart_count=1))
        follow_until(follower, 2, 10)
        assert follower.master(2) is None  # its master node has not published it yet
        store.put(keys.master(2), MasterAddress("10.0.0.2", 29501).to_dict())
        # waiting as the agent's loop does (a pushed update wakes it)
        wait_for(lambda: follower.wait(0.2) or follower.master(2), 10, "the address's push")
        assert follower.master(2) == MasterAddress("10.0.0.2", 29501)
        assert follower.current(time.monotonic()).generation == 2  # the plan is not disturbed
        store.put(keys.master(3), {"addr": "10.0.0.3"})  # invalid: no port
        store.put(keys.PLAN, plan(3, restart_count=2))
        follow_until(follower, 3, 10)
        assert follower.master(3) is None  # dropped, not a crash
        assert follower.master(2) is None  # a generation before the plan's: done, forgotten
        for junk in range(5):  # keys of generations no plan has: they push out nothing
            store.put(keys.master(10**6 + junk), MasterAddress("10.9.9.9", 1).to_dict())
        store.put(keys.PLAN, plan(4, restart_count=3))
        store.put(keys.master(4), MasterAddress("10.0.0.4", 29504).to_dict())
        follow_until(follower, 4, 10)
        wait_for(lambda: follower.wait(0.2) or follower.master(4), 10, "the address's push")
        assert follower.master(4) == MasterAddress("10.0.0.4", 29504)
        assert follower.reads == 1  # everything came pushed
    finally:
        follower.stop()


def test_a_summary_request_reaches_the_agent_on_the_plan_watch_and_is_answered_once(store):
    """The controller's NaN hold asks every member for its ranks' steps now (`plan/summaries`):
    pushed on the plan's watch, answered by the next summary (which names it), once."""
    store.put(keys.PLAN, plan(1))
    follower = PlanFollower(store)
    monitor = NodeMonitor("node0", nvml=MockNvml())
    try:
        follower.start(time.monotonic())
        monitor.new_generation(1)
        assert follower.summary_request() is None
        wait_for(lambda: follower.watch.healthy, 10, "the watch stream to be up")
        store.put(keys.SUMMARY_REQUEST, SummaryRequest(1, "node1-1-3").to_dict())
        wait_for(lambda: follower.wait(0.2) or follower.summary_request(), 10, "the push")
        asked = follower.summary_request()
        assert asked == SummaryRequest(1, "node1-1-3")
        assert monitor.answer(asked) and not monitor.answer(asked)  # the next summary, once
        assert monitor.collect()[0].answers == "node1-1-3"
        assert not monitor.answer(SummaryRequest(2, "node1-2-1"))  # another generation's
        store.put(keys.SUMMARY_REQUEST, {"generation": "one"})  # forged: not a request
        wait_for(
            lambda: follower.wait(0.2) or follower.summary_request() is None, 10, "the forgery"
        )
        assert follower.current(time.monotonic()).generation == 1  # the plan is not disturbed
        assert follower.reads == 1  # everything came pushed
    finally:
        monitor.close()
        follower.stop()


def test_a_plan_missed_while_cut_off_is_read_on_resync_and_the_stream_comes_back(store, proxied):
    cut_store, proxy = proxied
    store.put(keys.PLAN, plan(1))
    follower = PlanFollower(cut_store)
    try:
        follower.start(time.monotonic())
        wait_for(lambda: follower.watch.healthy, 10, "the watch stream to be up")
        proxy.set_blackhole()
        store.put(keys.PLAN, plan(2, restart_count=1))  # written while this node is cut off
        time.sleep(1.0)
        assert follower.current(time.monotonic()).generation == 1  # nothing came through
        proxy.set_pass()
        follower.resync(time.monotonic())
        assert follower.current(time.monotonic()).generation == 2
        reads = follower.reads
        wait_for(lambda: follower.watch.healthy, 20, "the watch stream to reconnect")
        store.put(keys.PLAN, plan(3, restart_count=2))
        follow_until(follower, 3, 10)
        assert follower.reads == reads  # pushed again, not read
    finally:
        proxy.set_pass()
        follower.stop()


def test_while_the_stream_is_down_the_plan_is_read_directly_at_a_bounded_rate(store):
    store.put(keys.PLAN, plan(1))
    follower = PlanFollower(store)
    try:
        follower.start(time.monotonic())
        follower.watch.stop()  # a stream that never comes back
        store.put(keys.PLAN, plan(2, restart_count=1))
        took = follow_until(follower, 2, 10)
        assert took < key_follow.FALLBACK_AFTER_S + key_follow.FALLBACK_READ_S + 1.0
        reads = follower.reads
        started = time.monotonic()
        while time.monotonic() - started < 2.0:
            follower.current(time.monotonic())
            follower.wait(agent_module.TICK_S)
        assert follower.reads - reads <= 2.0 / key_follow.FALLBACK_READ_S + 1
    finally:
        follower.stop()


# -- the lease keeper: is etcd there? -----------------------------------------------------------


def test_a_node_cut_off_from_etcd_enters_an_outage_and_its_cut_off_time_reaches_the_ttl(
    tmp_path, proxied
):
    cut_store, proxy = proxied
    ttl = 2
    agent = NodeAgent(cut_store, "node0", tmp_path)
    contact = agent.contact
    contact.ttl_s = ttl
    stopping = threading.Event()
    keeper = agent.keeper = LeaseKeeper(cut_store, contact, stopping)
    keeper.hold(cut_store.lease(ttl))
    keeper.start(ttl)
    try:
        time.sleep(1.0)
        assert not contact.check(time.monotonic())
        proxy.set_blackhole()
        cut_at = time.monotonic()

        def in_outage() -> bool:
            return contact.check(time.monotonic())

        wait_for(in_outage, 10, "the agent to notice it is cut off")
        # Noticed from the renewals alone (no read of the plan needed), before the lease can
        # expire: a TTL after the last renewal etcd answered (at most a renewal before the cut).
        assert contact.cut_off_s(time.monotonic()) < ttl
        assert contact.reached_at <= cut_at
        # Cut off past the TTL, and past etcd's own check of expired leases (every 0.5 s).
        wait_for(lambda: contact.cut_off_s(time.monotonic()) >= ttl + 1.5, 10, "a TTL cut off")
        assert in_outage()  # still cut off: the fence rule's input has reached the TTL
        proxy.set_pass()
        wait_for(lambda: not in_outage(), 20, "the agent to reach etcd again")
        assert keeper.lost.is_set()  # the lease expired meanwhile: the agent registers again
    finally:
        stopping.set()
        proxy.set_pass()
        agent.plan.stop()


# -- writes only when something changes ---------------------------------------------------------


def summary(
    t: float, step: int, beat_age: float = 0.2, anomalies=(), step_age: float = 0.1
) -> MonitorSummary:
    rank = RankSummary(step=step, step_age=step_age, beat_age=beat_age, step_s=0.1)
    return MonitorSummary("node0", 1, t, {"0": rank}, anomalies=list(anomalies))


def test_a_training_node_writes_its_summary_at_the_heartbeat_and_news_at_once(store):
    node = node_reports.NodeReports(store, "node0", "inc", lambda: (1, 5, 0))
    node.hang_floor_s = JobSpec(script="train.py").hang_floor_s
    times = []
    for i in range(101):  # 10 s of collections every 0.1 s, a step each
        now = 100.0 + i * 0.1
        before = dict(node._unsent)
        node.summary(summary(now, i), [], now)
        if node._unsent != before:
            times.append(now)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    allowed = node_reports.allowance(summary(0, 0), node.hang_floor_s)
    assert allowed == node_reports.SUMMARY_HEARTBEAT_S  # a stepping rank: the whole keep-alive
    assert len(times) == 2 and gaps[0] >= allowed - 1e-9  # progress waits: no news
    node.flush()
    anomaly = Anomaly("nan", Severity.CRITICAL, "nan", ["node0"], [0])
    anomaly.id = "a1"
    node.summary(summary(110.2, 33, anomalies=[anomaly]), [], 110.2)
    assert keys.monitor("node0") in node._unsent  # news: at once, not at the heartbeat
    node.flush()
    assert store.get(keys.monitor("node0"))["anomalies"][0]["id"] == "a1"
    node.summary(summary(110.3, 34, beat_age=2.6, anomalies=[anomaly]), [], 110.3)
    assert keys.monitor("node0") in node._unsent  # a heartbeat stopped: at once
    node.flush()
    # A rank that stops stepping (its step older than STEPPING_MIN_S here) is news at once, and
    # such a summary stands half the hang floor at most (its step ages truly meanwhile).
    quiet = summary(110.4, 34, beat_age=2.6, anomalies=[anomaly], step_age=1.5)
    node.summary(quiet, [], 110.4)
    assert keys.monitor("node0") in node._unsent
    assert node_reports.allowance(quiet, node.hang_floor_s) == node.hang_floor_s / 2


def test_the_heartbeat_keeps_the_controllers_extrapolated_view_true():
    floor = JobSpec(script="train.py").hang_floor_s
    assert node_reports.SUMMARY_HEARTBEAT_S + 1.0 < SUMMARY_GAP_S  # never a telemetry gap
    for beat_age in (0.0, 0.5, 1.0, 1.5):
        allowed = node_reports.allowance(summary(0, 1, beat_age), floor)
        assert allowed == node_reports.SUMMARY_HEARTBEAT_S  # a stepping rank: the keep-alive
        # A rank that steps and beats on never looks stuck or stopped to the controller, even
        # when the next write comes a margin late: its step and heartbeat age only past the
        # keep-alive (the agent writes at once when either stops).
        late = allowed + detectors.BEAT_MARGIN_S / 2
        [view] = detectors.rank_views({"node0": summary(0, 1, beat_age)}, 1, 0.0, {"node0": late})
        assert view["beat_age"] < HEARTBEAT_GAP_S
        assert view["step_age"] < detectors.STEPPING_MIN_S + detectors.BEAT_MARGIN_S < floor
    # A rank not stepping: its summary stands half the hang floor at most (SUMMARY_FLOOR_S at
    # least), and its step ages truly meanwhile: never a false hang, nor a late one.
    quiet = summary(0, 1, step_age=1.5)
    assert node_reports.allowance(quiet, floor) == floor / 2
    assert node_reports.allowance(quiet, 1.0) == node_reports.SUMMARY_FLOOR_S
    [view] = detectors.rank_views({"node0": quiet}, 1, 0.0, {"node0": 2.0})
    assert view["step_age"] == 3.5
    # A beat the agent said stopped ages truly between writes: found HEARTBEAT_GAP_S after it.
    stopped = summary(0, 1, detectors.BEAT_STOPPED_S)
    [view] = detectors.rank_views({"node0": stopped}, 1, 0.0, {"node0": detectors.BEAT_MARGIN_S})
    assert view["beat_age"] >= HEARTBEAT_GAP_S


def test_status_progress_is_written_at_a_first_step_and_state_changes_at_once(store):
    facts: list = [1, None, 0]  # generation, newest step, warm interpreters
    written = node_reports.NodeReports(store, "node0", "inc", lambda: tuple(facts))
    written.status(NodeState.RUNNING, pids={"0": 1})
    assert written.writes == 1
    facts[1] = 41
    now = time.monotonic()
    written.progress(now)
    assert written.writes == 2  # the generation's first step: training is back, at once
    assert store.get(keys.status("node0"))["step"] == 41
    for i in range(42, 60):
        facts[1] = i
        written.progress(now + i)  # however long after: later steps are the summaries'
    assert written.writes == 2
    facts[2] = 1  # a warm interpreter more: for people, at most every STATUS_PROGRESS_S
    written.progress(now + node_reports.STATUS_PROGRESS_S / 2)
    assert written.writes == 2
    written.progress(now + node_reports.STATUS_PROGRESS_S + 0.1)
    assert written.writes == 3
    facts[:2] = [2, 30]  # the next generation's first step (restored before 41)
    written.progress(now + node_reports.STATUS_PROGRESS_S + 0.2)
    assert written.writes == 4
    written.status(NodeState.FAILED, failures=[])
    assert (
        written.writes == 5 and store.get(keys.status("node0"))["state"] == NodeState.FAILED.value
    )


def test_a_turns_status_and_summary_reach_etcd_together_in_one_request(store):
    node = node_reports.NodeReports(store, "node0", "inc", lambda: (1, 5, 0))
    before = etcd_requests_by_method(store)
    with node.batch():
        node.status(NodeState.RUNNING, pids={"0": 1})
        node.summary(summary(100.0, 5), [], 100.0)
        assert store.get(keys.status("node0")) is None  # nothing before the turn ends
    after = etcd_requests_by_method(store)
    writes = sum(after.get(m, 0) - before.get(m, 0) for m in ("Put", "Txn"))
    assert writes == 1 and node.writes == 2
    assert store.get(keys.status("node0"))["state"] == NodeState.RUNNING.value
    assert store.get(keys.monitor("node0"))["ranks"]["0"]["step"] == 5


def test_a_transient_status_is_written_only_if_it_lasts(store):
    node = node_reports.NodeReports(store, "node0", "inc", lambda: (1, None, 0))
    node.status(NodeState.STARTING, quiet_s=30.0)
    node.flush()
    assert store.get(keys.status("node0")) is None and node.writes == 0
    node.status(NodeState.RUNNING, pids={"0": 1})  # started before it was due: never written
    assert store.get(keys.status("node0"))["state"] == NodeState.RUNNING.value
    assert node.writes == 1
    node.status(NodeState.STARTING, quiet_s=0.3)
    assert store.get(keys.status("node0"))["state"] == NodeState.RUNNING.value
    started = time.monotonic()

    def written() -> bool:
        node.flush()  # what the agent's turns do, every TICK_S
        return store.get(keys.status("node0"))["state"] == NodeState.STARTING.value

    wait_for(written, 5, "the lasting STARTING status")
    assert time.monotonic() - started >= 0.3 and node.writes == 2


def test_a_cut_off_node_waits_on_one_write_at_most_and_writes_the_rest_when_back(store, proxied):
    cut_store, proxy = proxied
    node = node_reports.NodeReports(cut_store, "node0", "inc", lambda: (1, 5, 0))
    node.status(NodeState.RUNNING)
    assert node.writes == 1 and not node.held
    proxy.set_blackhole()
    try:
        started = time.monotonic()
        node.status(
            NodeState.FAILED, failures=[FailureReport(FailureKind.FENCED)]
        )  # fails: etcd is cut off
        assert node.held and node.failure is not None
        first = time.monotonic() - started
        for i in range(10):  # what an agent's loop queues meanwhile: none of it waits on etcd
            due = i * (node_reports.SUMMARY_HEARTBEAT_S + 1.0)
            node.summary(summary(due, i), [], due)  # each one due
            node.flush()
            node.status(NodeState.FAILED, failures=[FailureReport(FailureKind.FENCED)])
        assert time.monotonic() - started < first + 0.5
    finally:
        proxy.set_pass()
    node.held = False  # the agent reached etcd again
    node.flush()
    assert store.get(keys.status("node0"))["state"] == NodeState.FAILED.value
    assert store.get(keys.monitor("node0"))["ranks"]["0"]["step"] == 9  # the newest summary
