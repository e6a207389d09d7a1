"""The event-driven controller against a real embedded etcd: its watched view of the agents
(transom/control/cluster_view.py) follows puts, deletes and an etcd restart; a member whose
lease expires is seen and a new plan published; a stall of etcd that expires leases is a
control-plane incident, not an eviction; a standby takes over within a bound after the leader
is SIGKILLed or hands over on SIGTERM (real `transom controller` processes)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from conftest import running_etcd, wait_for

from transom.checkpoint import catalog
from transom.common import keys
from transom.common.records import (
    JobRecord,
    MonitorSummary,
    NodeRegistration,
    NodeStatus,
    PreflightResult,
    RankSummary,
)
from transom.common.states import JobState, NodeState
from transom.control.cluster_view import WatchedCluster
from transom.control.controller import (
    EVENTS_KEPT_S,
    LEADER_TTL_S,
    TICK_S,
    Controller,
    tick_wait,
)
from transom.job_spec import JobSpec
from transom.store import EmbeddedEtcd, Store, StoreError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def etcd(tmp_path) -> Iterator[EmbeddedEtcd]:
    with running_etcd(tmp_path / "etcd") as server:
        yield server


@pytest.fixture
def store(etcd) -> Store:
    return Store(etcd.access, f"cw-{uuid.uuid4().hex[:8]}")


def poll(predicate: Callable[[], object], timeout: float, what: str) -> object:
    return wait_for(predicate, timeout, what, interval=0.02)


class FakeAgent:
    """A node's registration under its own lease, kept alive by a thread; like a real agent it
    registers again under a new lease when it finds its lease gone (a control-plane stall)."""

    def __init__(self, store: Store, node: str, ttl_s: int = 2, rejoin_after_s: float = 0.0):
        self.store, self.node, self.ttl_s, self.rejoin_after_s = store, node, ttl_s, rejoin_after_s
        self.stopping = threading.Event()
        self.registrations = 0
        self.lease = self._register()
        self.thread = threading.Thread(target=self._keep, daemon=True)
        self.thread.start()

    def _register(self):
        lease = self.store.lease(self.ttl_s)
        registration = NodeRegistration(self.node, "127.0.0.1", 1, time.time(), "inc-" + self.node)
        self.store.put(keys.node(self.node), registration.to_dict(), lease=lease)
        self.registrations += 1
        return lease

    def _keep(self) -> None:
        while not self.stopping.wait(self.ttl_s / 4):
            try:
                if not self.store.refresh(self.lease):
                    self.stopping.wait(self.rejoin_after_s)  # the agent's next ticks
                    self.lease = self._register()
            except StoreError:
                pass

    def die(self) -> None:
        """Stop and revoke the lease: the moment a dead node's lease expires."""
        self.stopping.set()
        self.thread.join(5)
        self.store.revoke(self.lease)


def publish(store: Store, node: str, running: bool = True) -> None:
    """A node's passed pre-flight and, for a member, its workers RUNNING generation 1."""
    now = time.time()
    store.put(keys.preflight(node), PreflightResult(True, now, compute_gflops=50.0).to_dict())
    if running:
        store.put(keys.status(node), NodeStatus(node, 1, NodeState.RUNNING, now).to_dict())


def put_spec(store: Store, **spec_fields) -> JobSpec:
    fields = dict(script=__file__, job_id=store.job_id, nproc_per_node=1, metrics_port=-1)
    spec = JobSpec(**{**fields, **spec_fields}).validate()
    store.put(keys.SPEC, spec.to_dict())
    return spec


def running_job(store: Store, members: list[str], **spec_fields) -> JobSpec:
    """A spec and a job record RUNNING generation 1 on `members`, as a leader left them."""
    spec = put_spec(store, **spec_fields)
    job = JobRecord.new(time.time())
    job.state, job.generation, job.members = JobState.RUNNING, 1, list(members)
    job.generation_started = time.time()
    store.put(keys.JOB, job.to_dict())
    return spec


class ControllerThread:
    def __init__(self, store: Store, name: str):
        self.controller = Controller(Store(store.access, store.job_id), name)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.code = self.controller.run()

    def stop(self) -> None:
        self.controller.terminated = True
        self.controller.stopping.set()
        self.thread.join(15)
        assert not self.thread.is_alive()


def plan_generation(store: Store) -> int:
    plan = store.get(keys.PLAN)
    return plan["generation"] if plan else 0


def event_kinds(store: Store) -> list[str]:
    return [e["kind"] for e in store.get_prefix(keys.EVENTS).values()]


def test_a_tick_comes_when_the_previous_asked_for_it_else_after_tick_s():
    # nothing asked: changes wait TICK_S from the previous tick's start, the timer decides
    assert tick_wait(10.0, 10.05, None) == (pytest.approx(TICK_S - 0.05), math.inf)
    assert tick_wait(10.0, 10.5, None) == (0.0, math.inf)
    # the next tick at once (a generation's plan)
    assert tick_wait(10.0, 10.05, 10.05) == (0.0, 0.0)
    # a rule due before TICK_S is up: then, changes or not
    assert tick_wait(10.0, 10.05, 10.1) == (pytest.approx(0.05), 0.0)
    # due later: changes may wake it after TICK_S, and it ticks at the due time at the latest
    floor, limit = tick_wait(10.0, 10.05, 10.5)
    assert floor == pytest.approx(TICK_S - 0.05) and limit == pytest.approx(0.3)
    assert tick_wait(10.0, 10.6, 10.5) == (0.0, 0.0)  # overdue: at once


# -- the view ---------------------------------------------------------------------------------


@pytest.mark.integration
def test_the_view_follows_puts_deletes_and_an_etcd_restart(tmp_path):
    server = EmbeddedEtcd(tmp_path / "etcd")
    view = None
    try:
        server.start()
        store = Store(server.access, "view")
        store.put(keys.node("a"), NodeRegistration("a", "h", 1, 1.0).to_dict())
        view = WatchedCluster(store)
        view.start()
        assert set(view.published().nodes) == {"a"}
        poll(lambda: view.current, 10, "the streams are up")

        store.put(keys.node("b"), {"not": "a registration"})  # alive, whatever it holds
        store.put(keys.status("a"), NodeStatus("a", 1, NodeState.RUNNING, 1.0).to_dict())
        store.put(keys.status("b"), "not a status")
        store.put(keys.monitor("a"), MonitorSummary("a", 1, 5.0).to_dict())
        published = poll(
            lambda: (p := view.published()).summaries and "b" in p.nodes and p, 10, "changes"
        )
        assert published.nodes["b"] is None and published.nodes["a"] is not None
        assert set(published.statuses) == {"a"}
        assert published.summaries["a"].t == 5.0
        assert published.summary_arrived and "a" in published.summary_arrived

        # Progress reports are taken in by the controller's timer; other changes wake it.
        poll(lambda: view.published().statuses, 10, "a's status")
        view.changed.clear()
        store.put(keys.monitor("a"), MonitorSummary("a", 1, 6.0).to_dict())
        store.put(keys.status("a"), NodeStatus("a", 1, NodeState.RUNNING, 2.0, step=7).to_dict())
        # Each name has a stream of its own: the status may come in before the summary put first
        poll(
            lambda: (p := view.published()).statuses["a"].step == 7 and p.summaries["a"].t == 6.0,
            10,
            "the next status and summary",
        )
        assert not view.changed.is_set()

        # ... unless a rank's timings shifted: a rank that begins to lag is evaluated at once.
        def summary(t: float, busy_s: float) -> dict:
            rank = RankSummary(step=int(t), step_s=0.2, compute_s=0.1, busy_s=busy_s)
            return MonitorSummary("a", 1, t, ranks={"0": rank}).to_dict()

        store.put(keys.monitor("a"), summary(7.0, 0.15))
        store.put(keys.monitor("a"), summary(8.0, 0.16))  # moved by less than a step's 1/4
        poll(lambda: view.published().summaries["a"].t == 8.0, 10, "the next summaries")
        assert not view.changed.is_set()
        store.put(keys.monitor("a"), summary(9.0, 0.22))  # by more (waiting.TIMING_SHIFT_FRACTION)
        assert view.changed.wait(10)
        assert not view.pressing.is_set()  # a lagging rank is no incident
        view.changed.clear()
        stuck = MonitorSummary("a", 1, 9.5, ranks={"0": RankSummary(step=9, where="stopped")})
        store.put(keys.monitor("a"), stuck.to_dict())  # a stuck node's places: the hang rule's
        assert view.changed.wait(10)
        assert view.pressing.is_set()
        view.changed.clear()
        view.pressing.clear()
        # A new replica fingerprint: a corrupted rank trains on until the steps' are compared.
        printed = RankSummary(step=10, fingerprints={"10": "00" * 8})
        store.put(keys.monitor("a"), MonitorSummary("a", 1, 9.7, ranks={"0": printed}).to_dict())
        assert view.changed.wait(10)
        assert view.pressing.is_set()
        view.changed.clear()
        view.pressing.clear()
        store.put(keys.monitor("a"), MonitorSummary("a", 1, 9.8, ranks={"0": printed}).to_dict())
        poll(lambda: view.published().summaries["a"].t == 9.8, 10, "the same fingerprint again")
        assert not view.pressing.is_set() and not view.changed.is_set()
        answer = MonitorSummary("a", 1, 9.9, ranks={"0": printed}, answers="b-1-1")
        store.put(keys.monitor("a"), answer.to_dict())  # a NaN's hold waits for it
        assert view.changed.wait(10)
        assert view.pressing.is_set()
        view.changed.clear()
        view.pressing.clear()
        store.put(keys.status("a"), NodeStatus("a", 1, NodeState.FAILED, 3.0, step=7).to_dict())
        assert view.changed.wait(10)
        assert view.pressing.is_set()  # a failure: the controller ticks without its floor
        view.pressing.clear()
        store.put(keys.status("a"), NodeStatus("a", 1, NodeState.FAILED, 4.0, step=7).to_dict())
        poll(lambda: view.published().statuses["a"].time == 4.0, 10, "the failure again")
        assert not view.pressing.is_set()  # the same failure is no new incident
        store.put(keys.status("a"), NodeStatus("a", 2, NodeState.SUCCEEDED, 5.0).to_dict())
        assert poll(view.pressing.is_set, 10, "done")  # its workers all done: the job may end
        view.pressing.clear()

        deleted_before = view.node_deleted_at
        store.delete(keys.node("a"))
        poll(lambda: "a" not in view.published().nodes, 10, "a's registration deleted")
        assert view.node_deleted_at > deleted_before
        assert view.pressing.is_set()  # a node gone

        server.stop()
        poll(lambda: not view.current, 10, "the view knows it is stale")
        server.start()  # same data, same ports (new certificates in the same files)
        store = Store(server.access, "view")
        store.put(keys.node("c"), NodeRegistration("c", "h", 1, 2.0).to_dict())
        store.delete(keys.node("b"))
        poll(lambda: set(view.published().nodes) == {"c"}, 20, "changes after the restart")
        poll(lambda: view.current, 10, "the streams are up again")
    finally:
        if view is not None:
            view.stop()
        server.stop()


# -- the leader -------------------------------------------------------------------------------


def test_a_member_whose_lease_expires_is_replaced_in_a_new_plan(store):
    running_job(store, ["node0", "node1"], nnodes_min=2, nnodes_max=2, spares=1, settle_s=0.5)
    agents = {n: FakeAgent(store, n) for n in ("node0", "node1", "node2")}
    for n in agents:
        publish(store, n, running=n != "node2")  # node2: a spare
    ctl = ControllerThread(store, "ctl-a")
    try:
        poll(lambda: store.get(keys.LEADER) == "ctl-a", 20, "ctl-a leads")
        time.sleep(1.0)  # a few ticks on an unchanged cluster: nothing to decide
        assert plan_generation(store) == 0 and "evict" not in event_kinds(store)
        agents["node1"].die()
        died = time.monotonic()
        poll(lambda: plan_generation(store) == 2, 15, "the plan of generation 2")
        took = time.monotonic() - died
        plan = store.get(keys.PLAN)
        assert plan["members"] == ["node0", "node2"]
        # settle_s, then one tick to decide and one to write the plan: no polling interval
        assert took < 0.5 + 2.5, took
        at = {e["kind"]: e["time"] for e in store.get_prefix(keys.EVENTS).values()}
        # the plan's tick follows the deciding one at once, not TICK_S later
        assert at["generation"] - at["diagnosis"] < TICK_S / 2, at
    finally:
        ctl.stop()
        for agent in agents.values():
            agent.stopping.set()


def test_the_next_plan_waits_for_the_members_checkpoint_servers_to_send_their_holdings(store):
    """Memory listings are lazy (batch_writer.LAZY_S): the restore step is read only once each
    surviving member with a registered checkpoint server said it sent what it holds
    (`catalog.Flushed`, written here 0.8 s after the server sees RECOVERING)."""
    running_job(store, ["node0", "node1"], nnodes_min=2, nnodes_max=2, spares=1, settle_s=0.5)
    agents = {n: FakeAgent(store, n) for n in ("node0", "node1", "node2")}
    for n in agents:
        publish(store, n, running=n != "node2")
    lease = agents["node0"].lease
    catalog.register_server(store, "node0", "127.0.0.1:1", lease)
    flushed_at: list[float] = []

    def server() -> None:  # node0's server: its word, a while after the recovery began
        poll(lambda: (store.get(keys.PLAN) or {}).get("job_state") == "RECOVERING", 30, "it")
        time.sleep(0.8)  # a slow flush (settle_s is 0.5), not a synchronisation
        store.put(keys.ckpt_flushed("node0"), catalog.Flushed(1).to_dict(), lease=lease)
        flushed_at.append(time.time())

    flusher = threading.Thread(target=server, daemon=True)
    flusher.start()
    ctl = ControllerThread(store, "ctl-f")
    try:
        poll(lambda: store.get(keys.LEADER) == "ctl-f", 20, "ctl-f leads")
        agents["node1"].die()
        poll(lambda: plan_generation(store) == 2, 15, "the plan of generation 2")
        flusher.join(10)
        at = {e["kind"]: e["time"] for e in store.get_prefix(keys.EVENTS).values()}
        assert flushed_at and at["generation"] >= flushed_at[0], (at, flushed_at)
        assert at["generation"] - flushed_at[0] < 0.5  # at once after the word, polled
    finally:
        ctl.stop()
        for agent in agents.values():
            agent.stopping.set()


def test_an_etcd_stall_that_expires_a_lease_is_an_incident_not_an_eviction(etcd, store):
    # Two members: node1's lease outlives the stall, node0's does not. One of two vanishing is
    # not "many at once", so only the gap the controller measured excuses node0, which comes
    # back within the grace period (node TTL + 2 s).
    running_job(store, ["node0", "node1"], nnodes_min=2, nnodes_max=2, node_ttl_s=2)
    agents = {
        "node0": FakeAgent(store, "node0", ttl_s=2, rejoin_after_s=1.5),
        "node1": FakeAgent(store, "node1", ttl_s=30),
    }
    for n in agents:
        publish(store, n)
    ctl = ControllerThread(store, "ctl-a")
    try:
        poll(lambda: store.get(keys.LEADER) == "ctl-a", 20, "ctl-a leads")
        time.sleep(1.0)
        assert etcd.process is not None
        os.kill(etcd.process.pid, signal.SIGSTOP)
        time.sleep(LEADER_TTL_S + 1.0)  # longer than node0's TTL and the leader's
        os.kill(etcd.process.pid, signal.SIGCONT)
        poll(lambda: agents["node0"].registrations >= 2, 20, "node0 registered again")
        poll(lambda: "control-plane incident over" in str(store.get_prefix(keys.EVENTS)), 10,
             "the incident is over")  # fmt: skip
        time.sleep(1.0)  # what the controller does next, once node0 is back
        messages = [e["message"] for e in store.get_prefix(keys.EVENTS).values()]
        # It lost its own lease in the stall too, led again and knew about the gap:
        assert any("after etcd did not answer it for" in m for m in messages), messages
        kinds = event_kinds(store)
        assert "evict" not in kinds and "incident" not in kinds, kinds
        assert plan_generation(store) == 0  # no restart (generation 1 was never rewritten)
        assert store.get(keys.JOB)["members"] == ["node0", "node1"]
    finally:
        ctl.stop()
        for agent in agents.values():
            agent.stopping.set()


# -- standbys -------------------------------------------------------------------------------


def test_a_standby_takes_over_after_a_sigkill_and_at_once_after_a_hand_over(etcd, store):
    put_spec(store, nnodes_min=1, nnodes_max=1, join_timeout_s=600)  # PENDING: no node comes
    base = [sys.executable, "-m", "transom", "--log-level", "warning", "controller"]
    common = [*etcd.access.argv(), "--job-id", store.job_id]
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in ("ctl-0", "ctl-1", "ctl-2"):
            procs[name] = subprocess.Popen([*base, *common, "--candidate-id", name])
        first = poll(lambda: store.get(keys.LEADER), 60, "a leader")
        assert isinstance(first, str)
        time.sleep(1.0)  # the standbys are waiting on the leader key by now
        procs[first].kill()  # no hand-over: its lease must expire
        killed = time.monotonic()
        second = poll(lambda: (v := store.get(keys.LEADER)) not in (None, first) and v, 15, "b")
        took = time.monotonic() - killed
        # The lease expires LEADER_TTL_S after its last refresh (etcd checks every 0.5 s).
        assert took < LEADER_TTL_S + 1.5, took
        assert isinstance(second, str)
        procs[second].send_signal(signal.SIGTERM)  # hands over: revokes its lease on exit
        handed = time.monotonic()
        third = poll(lambda: (v := store.get(keys.LEADER)) not in (None, second) and v, 10, "c")
        assert time.monotonic() - handed < 2.0
        assert third not in (first, second)
        assert procs[second].wait(10) == 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)


def test_the_leader_deletes_the_events_older_than_the_retention_and_keeps_the_rest(store):
    running_job(store, ["node0"], nnodes_min=1, nnodes_max=1)
    publish(store, "node0")
    now = time.time()
    old = now - EVENTS_KEPT_S - 60.0
    kept = now - EVENTS_KEPT_S + 120.0  # inside the retention by two minutes
    for t in (old - 1.0, old):
        store.put(keys.event(t, "node0"), {"time": t, "kind": "warning", "message": "old"})
    store.put(keys.event(kept, "node0"), {"time": kept, "kind": "warning", "message": "kept"})
    ctl = ControllerThread(store, "ctl-a")
    try:
        poll(lambda: store.get(keys.LEADER) == "ctl-a", 20, "ctl-a leads")
        poll(lambda: "old" not in messages(store), 10, "the old events deleted")
        assert "kept" in messages(store)
    finally:
        ctl.stop()


def messages(store: Store) -> list[str]:
    return [e["message"] for e in store.get_prefix(keys.EVENTS).values()]
