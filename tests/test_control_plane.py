"""Unit tests of the rules that keep a control-plane fault from becoming a job failure (issue 11).

Pure: `decide` with snapshots (control-plane incidents, a cut-off node, a skewed agent clock,
a restarted agent rejoining), the controller's observations on its own clock
(control/observed.py), the agent's one clock of its contact with etcd and the thresholds that
count from it (control/node_contact.py: outage, pause, fence), fed by a lease keeper's renewals,
and the pause guard's thread (control/fence.py) on a lease keeper that renews nothing. No etcd,
no processes.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from test_decisions import T0, kinds, nodes, run, running, spec, statuses

from transom.common.records import (
    Anomaly,
    EventKind,
    MonitorSummary,
    NodeRegistration,
    RankSummary,
    Severity,
)
from transom.common.states import JobState, NodeState
from transom.control.fence import PauseGuard
from transom.control.grace import grace_s, lease_stall_s
from transom.control.lease_keeper import LeaseKeeper
from transom.control.monitor_rules import SUMMARY_GAP_S
from transom.control.node_contact import (
    OVERDUE_TTL_SHARE,
    PAUSE_TTL_SHARE,
    NodeContact,
    fence_reason,
    pause_reason,
)
from transom.control.observed import MIN_GAP_S, Observed
from transom.control.tick import Snapshot
from transom.store import StoreError

MEMBERS = ["node0", "node1", "node2"]


def live_snapshot(*alive: str, **fields) -> Snapshot:
    return Snapshot(nodes(*alive), statuses(1, NodeState.RUNNING, *MEMBERS), **fields)


# -- control-plane incidents ----------------------------------------------------------------------


def test_leases_lost_in_a_stall_the_controller_saw_are_excused_while_members_register_again():
    s = spec(nnodes_min=3, nnodes_max=3, spares=1)
    job = running(MEMBERS, s)
    # etcd paused 6 s: the controller's own calls stalled (a gap that ended 0.2 s ago), and
    # on resume etcd revoked every lease it had not renewed: node2's first.
    stalled = live_snapshot("node0", "node1", store_gap_s=6.0, since_store_gap_s=0.2)
    d = run(job, stalled, s, T0 + 10)
    assert d.job.state is JobState.RUNNING and d.job.incident is None
    assert kinds(d) == ["warning"] and "control-plane incident" in d.events[0].message
    assert "etcd did not answer the controller for 6.0 s" in d.events[0].message
    # every lease gone in the next tick: still the same incident (no second warning)
    gone = live_snapshot(store_gap_s=6.0, since_store_gap_s=0.4)
    d = run(d.job, gone, s, T0 + 10.2, d.memory)
    assert d.job.state is JobState.RUNNING and not d.events
    # the agents register again under the same ids: incident over, workers kept
    back = live_snapshot(*MEMBERS, store_gap_s=6.0, since_store_gap_s=1.5)
    d = run(d.job, back, s, T0 + 11.3, d.memory)
    assert d.job.state is JobState.RUNNING and d.job.restarts_used == 0 and not d.job.evicted
    assert kinds(d) == ["warning"] and "incident over" in d.events[0].message


def test_a_member_that_does_not_return_within_the_grace_period_is_lost():
    s = spec(nnodes_min=2, nnodes_max=3, spares=0)
    job = running(MEMBERS, s)
    d = run(job, live_snapshot("node0", "node1", store_gap_s=5.0, since_store_gap_s=0.1), s, T0)
    assert d.job.state is JobState.RUNNING
    late = T0 - 0.1 + grace_s(s) + 0.1  # the grace period, counted from the gap's end, is over
    snap = live_snapshot("node0", "node1", store_gap_s=5.0, since_store_gap_s=late - T0 + 0.1)
    d = run(d.job, snap, s, late, d.memory)
    assert d.job.state is JobState.RECOVERING and "node2 lost" in d.job.reason


def test_many_leases_vanishing_at_once_is_a_control_plane_incident_even_without_a_gap():
    s = spec(nnodes_min=3, nnodes_max=3)
    job = running(MEMBERS, s)
    d = run(job, live_snapshot("node0"), s, T0 + 1)  # two of three in the same tick, no gap
    assert d.job.state is JobState.RUNNING
    assert "2 of 3 members' leases vanished at once" in d.events[0].message
    d = run(d.job, live_snapshot("node0"), s, T0 + 1 + grace_s(s) + 0.1, d.memory)
    assert d.job.state is JobState.RECOVERING


def test_a_single_node_cut_off_while_etcd_answers_the_controller_is_still_lost():
    s = spec(nnodes_min=2, nnodes_max=3, spares=1)
    job = running(MEMBERS, s)
    # no gap the controller saw (or one long over), one lease gone: a node death
    for since_gap in (None, grace_s(s) + 1):
        snap = live_snapshot(
            "node0", "node1", "node3", store_gap_s=3.0, since_store_gap_s=since_gap
        )
        d = run(job, snap, s, T0 + 1)
        assert d.job.state is JobState.RECOVERING and "node2 lost" in d.job.reason


def test_a_lease_gone_when_a_standby_takes_the_lead_is_excused_until_the_node_registers():
    # etcd paused longer than the leader's lease: on resume it revoked the leader's lease and
    # node2's; the standby, which waits on a watch and so saw no gap of its own, took the lead
    # 0.5 s ago. One lease of three is not "many at once", yet it is no node death either.
    s = spec(nnodes_min=2, nnodes_max=3, spares=1)
    job = running(MEMBERS, s)
    snap = live_snapshot("node0", "node1", "node3", since_takeover_s=0.5)
    d = run(job, snap, s, T0 + 1)
    assert d.job.state is JobState.RUNNING and d.job.restarts_used == 0
    assert "took the lead 0.5 s ago" in d.events[0].message
    back = live_snapshot(*MEMBERS, "node3", since_takeover_s=1.5)
    d = run(d.job, back, s, T0 + 2, d.memory)
    assert d.job.state is JobState.RUNNING and not d.job.evicted
    assert "incident over" in d.events[0].message
    # one that does not come back is lost once the grace period, counted from the takeover, ends
    late = 0.5 + grace_s(s) + 0.1
    d = run(job, snap, s, T0 + 1)
    gone = live_snapshot("node0", "node1", "node3", since_takeover_s=late)
    d = run(d.job, gone, s, T0 + 1 - 0.5 + late, d.memory)
    assert d.job.state is JobState.RECOVERING and "node2 lost" in d.job.reason
    # a lease lost after the takeover's first snapshot is the node's own death, acted on at once
    d = run(job, live_snapshot(*MEMBERS, "node3", since_takeover_s=0.2), s, T0)
    d = run(d.job, live_snapshot("node0", "node1", "node3"), s, T0 + 2, d.memory)
    assert d.job.state is JobState.RECOVERING and "node2 lost" in d.job.reason


def test_a_gap_too_short_to_have_expired_a_lease_excuses_no_lost_node():
    # A busy etcd or controller answered the controller's probe 1.4 s late (seen at 512 nodes
    # on 2 cores): with 20 s leases no lease can have expired in that, so a lease gone is the
    # node's own death, acted on at once, not after waiting out the grace period.
    s = spec(nnodes_min=2, nnodes_max=3, spares=1, node_ttl_s=20)
    assert lease_stall_s(s) > 1.4
    job = running(MEMBERS, s)
    snap = live_snapshot("node0", "node1", "node3", store_gap_s=1.4, since_store_gap_s=0.5)
    d = run(job, snap, s, T0 + 1)
    assert d.job.state is JobState.RECOVERING and "node2 lost" in d.job.reason
    # the same lease lost in a stall long enough to expire it is excused
    long = live_snapshot(
        "node0", "node1", "node3", store_gap_s=lease_stall_s(s), since_store_gap_s=0.5
    )
    d = run(job, long, s, T0 + 1)
    assert d.job.state is JobState.RUNNING and "control-plane incident" in d.events[0].message
    # the smallest leases keep the 1 s rule
    assert lease_stall_s(spec(node_ttl_s=2)) == MIN_GAP_S


# -- one clock ----------------------------------------------------------------------------------


def summary(node: str, t: float, step: int) -> MonitorSummary:
    ranks = {str(MEMBERS.index(node)): RankSummary(step, None, 0.2, 0.1, 0.15)}
    return MonitorSummary(node, 1, t, ranks)


def test_agent_clocks_30_s_behind_give_no_false_hang_or_telemetry_gap():
    s = spec(nnodes_min=3, nnodes_max=3, hang_floor_s=5.0)
    job = running(MEMBERS, s)
    observed = Observed()
    memory = None
    for tick in range(60):  # 12 s of ticks; the agents publish every second
        now, mono = T0 + tick * 0.2, 100.0 + tick * 0.2
        step = tick // 5
        skews = {"node0": -30.0, "node1": -31.0, "node2": -29.0}  # every agent's clock behind
        summaries = {n: summary(n, now + skew - tick % 5 * 0.2, step) for n, skew in skews.items()}
        observed.reached(mono, mono)
        ages = observed.summary_ages(summaries, mono)
        snap = live_snapshot(*MEMBERS, summaries=summaries, summary_ages=ages)
        d = run(job, snap, s, now, memory)
        memory = d.memory
        assert d.job.state is JobState.RUNNING, d.events
        assert not [e for e in d.events if e.kind in (EventKind.ANOMALY, EventKind.WARNING)]
        job = d.job


def test_a_summary_that_stopped_changing_is_a_telemetry_gap_on_the_controllers_clock():
    observed = Observed()
    frozen = {"node1": summary("node1", T0 + 1000.0, 3)}  # far in the future: irrelevant
    observed.reached(100.0, 100.0)
    assert observed.summary_ages(frozen, 100.0) == {"node1": 0.0}
    for tick in range(1, 61):  # 12 s of ordinary ticks, the summary never changes
        observed.reached(100.0 + tick * 0.2, 100.0 + tick * 0.2 - 0.05)
    assert observed.summary_ages(frozen, 112.0) == {"node1": 12.0} and SUMMARY_GAP_S < 12.0
    s = spec(nnodes_min=3, nnodes_max=3, hang_floor_s=60.0)
    job = running(MEMBERS, s)
    snap = live_snapshot(*MEMBERS, summaries=frozen, summary_ages={"node1": 12.0})
    d = run(job, snap, s, T0)
    assert any(e.type == "telemetry_gap" for e in d.events)


def test_a_gap_in_reaching_etcd_restarts_every_summary_age_and_is_reported():
    observed = Observed()
    summaries = {"node0": summary("node0", T0, 5)}
    observed.reached(10.0, 10.0)
    observed.summary_ages(summaries, 10.0)
    observed.reached(10.3, 10.2)  # a normal tick: no gap
    assert observed.since_gap(10.3) is None
    observed.reached(17.0, 10.5)  # the snapshot stalled for 6.5 s (etcd paused)
    assert observed.gap_s >= MIN_GAP_S and observed.since_gap(17.5) == 0.5
    assert observed.summary_ages(summaries, 17.5) == {"node0": 0.5}  # not 7.5 s: unseen


def test_nan_reports_are_held_from_when_the_controller_first_saw_them_not_their_agent_time():
    s = spec(nnodes_min=3, nnodes_max=3)
    job = running(MEMBERS, s)
    nan = Anomaly("nan", Severity.CRITICAL, "loss is nan", ["node2"], [2], time=T0 + 30, step=9)
    nan.id, nan.generation = "node2-1-1", 1
    summaries = {"node2": MonitorSummary("node2", 1, T0 + 30, anomalies=[nan])}
    snap = live_snapshot(*MEMBERS, summaries=summaries, summary_ages={"node2": 0.0})
    d = run(job, snap, s, T0)  # the agent's clock is 30 s ahead: held, not forever
    assert d.job.state is JobState.RUNNING
    d = run(job, snap, s, T0 + 0.6, d.memory)
    assert d.job.state is JobState.RECOVERING and d.job.rollback_before == 9


# -- a restarted agent rejoins --------------------------------------------------------------------


def test_an_evicted_node_whose_agent_started_again_rejoins_as_a_spare():
    s = spec(nnodes_min=2, nnodes_max=2, spares=1)
    job = running(["node0", "node1"], s)
    first = NodeRegistration("node2", "127.0.0.1", 1, T0, incarnation="aaa")
    snap = Snapshot(
        {**nodes("node0", "node1"), "node2": first},
        statuses(1, NodeState.RUNNING, "node0", "node1"),
    )
    d = run(job, snap, s, T0)
    job = d.job
    job.evicted = {}
    from transom.common.records import Eviction

    job.evicted["node2"] = Eviction("node lost", T0, 1, incarnation="aaa")
    assert not run(job, snap, s, T0 + 1).job.evicted == {}  # the same agent: stays evicted
    again = NodeRegistration("node2", "127.0.0.1", 2, T0 + 5, incarnation="bbb")
    snap.nodes["node2"] = again
    d = run(job, snap, s, T0 + 6)
    assert "node2" not in d.job.evicted and d.plan is not None and "node2" not in d.plan.evicted
    assert [e.kind for e in d.events] == [EventKind.SPARE] and "rejoins" in d.events[0].message


def test_an_eviction_records_the_agent_incarnation_it_evicted():
    s = spec(nnodes_min=2, nnodes_max=2, spares=1)
    job = running(["node0", "node1"], s)
    status1 = statuses(1, NodeState.RUNNING, "node0", "node1")
    status1["node1"].incarnation = "n1-first"
    snap = Snapshot(nodes("node0", "node2"), status1)
    d = run(job, snap, s, T0 + 1)
    d = run(d.job, snap, s, T0 + 3, d.memory)  # settled: node1 lost, evicted
    assert d.job.evicted["node1"].incarnation == "n1-first"


# -- the agent's fence rule -----------------------------------------------------------------------


def test_workers_train_on_through_a_short_outage_and_pause_before_the_lease_can_expire():
    ttl = 4.0
    assert pause_reason(0.0, ttl, lease_lost=False) is None
    assert pause_reason(PAUSE_TTL_SHARE * ttl - 0.01, ttl, lease_lost=False) is None
    assert "may expire" in pause_reason(PAUSE_TTL_SHARE * ttl, ttl, lease_lost=False)
    assert PAUSE_TTL_SHARE * ttl <= ttl - 0.5  # the agent's turn and the signal fit before expiry
    # etcd answered that the lease expired: the controller may already have moved on
    assert "expired" in pause_reason(0.1, ttl, lease_lost=True)


def test_workers_are_given_up_only_after_the_outage_limit():
    assert fence_reason(59.9, 60.0) is None
    assert "--store-outage 60" in fence_reason(60.0, 60.0)


def contact_at(t: float, ttl_s: float = 8.0) -> NodeContact:
    contact = NodeContact("agent node0", t)
    contact.ttl_s = ttl_s
    return contact


def test_one_contact_clock_counts_the_outage_the_pause_and_the_fence():
    """Every threshold counts from the newest lease request etcd answered, on one clock."""
    contact = contact_at(100.0)  # the agent began: cut off from then until etcd answers
    contact.granted(100.5)  # registered: the lease's grant was asked for at 100.5
    contact.renewed(104.0)  # a renewal sent at 104.0 was answered
    contact.renewed(103.0)  # an older answer (never moves the clock back)
    assert contact.reached_at == 104.0 and contact.cut_off_s(105.0) == 1.0
    overdue_at = 104.0 + OVERDUE_TTL_SHARE * 8.0  # 109.0
    assert not contact.check(overdue_at)  # at the threshold, not past it
    assert contact.pause_due(overdue_at, lease_lost=False) is None
    assert contact.check(overdue_at + 0.01)  # no answer for 5/8 of the TTL: an outage...
    assert contact.outage.since == 104.0  # ...that began when etcd last answered
    assert contact.pause_in_s(overdue_at) == (PAUSE_TTL_SHARE - OVERDUE_TTL_SHARE) * 8.0
    assert contact.pause_due(109.9, lease_lost=False) is None
    assert "may expire" in contact.pause_due(110.0, lease_lost=False)  # 3/4 of the TTL
    assert "expired" in contact.pause_due(104.1, lease_lost=True)  # etcd said so: at once
    assert contact.fence_due(163.9, 60.0) is None
    assert "--store-outage 60" in contact.fence_due(164.0, 60.0)
    contact.renewed(170.0)  # etcd answers again: the outage ends at the next check
    assert not contact.check(170.1) and contact.cut_off_s(170.1) == pytest.approx(0.1)
    assert contact.pause_due(170.1, lease_lost=False) is None


def test_a_failed_renewal_or_call_is_an_outage_until_a_later_lease_request_is_answered():
    contact = contact_at(100.0)
    contact.renewed(104.0)
    contact.renewal_failed(StoreError("no answer"))
    assert contact.check(104.5) and contact.outage.since == 104.0  # at once, not when overdue
    contact.renewed(108.0)  # the next renewal answered: the error is over
    assert not contact.check(108.2)
    # A call of the agent's loop failed: an outage from the newest answer its turn's check
    # read, which only a later lease request answered ends (the agent polls nothing else).
    contact.failed(StoreError("put timed out"))
    assert contact.check(108.3) and contact.outage.since == 108.0
    contact.granted(108.0)  # not later: still out
    assert contact.check(108.4)
    contact.granted(108.4)  # a new lease granted: its request was answered
    assert not contact.check(108.5)
    contact.renewed(108.6)  # answered during the turn that began with that check...
    contact.failed(StoreError("put timed out"))  # ...whose call then failed
    assert contact.outage.since == 108.4  # the turn's reading: the next check ends it
    assert not contact.check(108.7)
    # A grant is no renewal: a renewal's failure still stands until a renewal is answered.
    contact.renewal_failed(StoreError("no answer"))
    contact.granted(109.0)
    assert contact.check(109.1)
    contact.renewed(109.2)
    assert not contact.check(109.3)


class FakeLeaseStore:
    """`refresh` answers `alive`, or raises StoreError when `alive` is None."""

    def __init__(self) -> None:
        self.alive: bool | None = True

    def refresh(self, lease) -> bool:
        if self.alive is None:
            raise StoreError("no answer")
        return self.alive


def test_the_lease_keeper_feeds_every_renewal_answer_to_the_contact_clock():
    contact = contact_at(time.monotonic())
    store = FakeLeaseStore()
    keeper = LeaseKeeper(store, contact, threading.Event())  # type: ignore[arg-type]
    lease = SimpleNamespace(renewed_at=contact.reached_at + 0.5)
    keeper.hold(lease)  # type: ignore[arg-type]
    assert contact.reached_at == lease.renewed_at  # the grant counts
    store.alive = None
    keeper.renew()
    assert isinstance(contact.error, StoreError) and contact.reached_at == lease.renewed_at
    store.alive = False  # "this lease has expired" is an answer too
    before = time.monotonic()
    keeper.renew()
    assert contact.error is None and contact.reached_at >= before and keeper.lost.is_set()


class GuardedNode:
    """A pause guard on a lease keeper that renews nothing (the test moves the contact's
    `reached_at`); each pause is recorded with its time and how often the guard had read the
    cut-off by then."""

    def __init__(self, ttl_s: float):
        self.stopping = threading.Event()
        self.contact = contact_at(time.monotonic(), ttl_s)
        self.keeper = LeaseKeeper(None, self.contact, self.stopping)  # type: ignore[arg-type]
        self.reads = 0
        self.pauses: list[tuple[float, str, int]] = []
        self.paused = threading.Event()
        cut_off_s = self.contact.cut_off_s

        def counted(now: float) -> float:
            self.reads += 1
            return cut_off_s(now)

        self.contact.cut_off_s = counted  # type: ignore[method-assign]
        self.guard = PauseGuard(self.keeper, self._pause, self.stopping)
        self.contact.reached_at = self.started = time.monotonic()
        self.guard.start()

    def _pause(self, reason: str) -> None:
        self.pauses.append((time.monotonic(), reason, self.reads))
        self.paused.set()


def test_the_pause_guard_sleeps_until_the_pause_is_due_instead_of_polling():
    node = GuardedNode(ttl_s=2.0)
    try:
        time.sleep(0.5)  # a renewal answered: the pause moves 0.5 s later
        renewed = node.contact.reached_at = time.monotonic()
        assert node.paused.wait(10.0)
        at, reason, reads = node.pauses[0]
        assert at - renewed >= PAUSE_TTL_SHARE * 2.0 and "may expire" in reason
        assert reads <= 6, reads  # woke at the due times, not 20 times at 0.1 s
    finally:
        node.stopping.set()


def test_the_pause_guard_pauses_at_once_when_the_lease_is_lost():
    node = GuardedNode(ttl_s=40.0)  # the cut-off alone would pause after 30 s
    try:
        time.sleep(0.2)
        node.keeper.lost.set()
        assert node.paused.wait(5.0)
        assert "expired" in node.pauses[0][1]
        assert node.pauses[0][0] - node.started < 5.0
    finally:
        node.stopping.set()
