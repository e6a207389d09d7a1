"""Unit tests of the controller's rules (transom/control/decisions.py), one rule at a time.

No etcd, no processes: a job record and a snapshot go in, a Decision comes out.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from transom.common.records import (
    Anomaly,
    EventKind,
    FailureReport,
    JobRecord,
    MonitorSummary,
    NextGeneration,
    NodeRegistration,
    NodeStatus,
    PreflightResult,
    RankSummary,
    Severity,
    SummaryRequest,
    parse_all,
)
from transom.common.states import JobState, NodeState
from transom.control.decisions import DISCARD_AFTER_S, PREFLIGHT_WAIT_S, decide
from transom.control.grace import REREGISTER_MARGIN_S
from transom.control.monitor_rules import NUMERICS_SETTLE_S
from transom.control.policy import LEASE_EXPIRED
from transom.control.set_aside import SILENT_AGENT_S
from transom.control.tick import Decision, Memory, Snapshot, Tick
from transom.job_spec import JobSpec

T0 = 1000.0


def spec(**overrides) -> JobSpec:
    fields = dict(script="train.py", nnodes_min=2, nnodes_max=2, max_restarts=2)
    return JobSpec(**{**fields, **overrides})


def nodes(*names: str) -> dict[str, NodeRegistration | None]:
    return {n: NodeRegistration(n, "127.0.0.1", 1, T0) for n in names}


def passed(*names: str, gflops: float = 50.0) -> dict[str, PreflightResult]:
    return {n: PreflightResult(True, T0, compute_gflops=gflops) for n in names}


def status(node: str, generation: int, state: NodeState, **fields) -> NodeStatus:
    return NodeStatus(node, generation, state, T0, **fields)


def statuses(generation: int, state: NodeState, *names: str) -> dict[str, NodeStatus]:
    return {n: status(n, generation, state) for n in names}


def crash(rank: int, peer_error: bool = False) -> FailureReport:
    return FailureReport(
        describe=f"rank {rank} killed by SIGKILL",
        time=T0,
        peer_error=peer_error,
        rank=rank,
        exitcode=-9,
        signal="SIGKILL",
    )


def kinds(d: Decision) -> list[str]:
    return [e.kind.value for e in d.events]


def run(job: JobRecord, snap: Snapshot, s: JobSpec, now: float, memory=None) -> Decision:
    """One tick, checking that decide() is pure and what it writes survives etcd's JSON."""
    before = job.to_dict()
    d = decide(job, snap, s, now, memory)
    assert job.to_dict() == before  # the input record is not modified
    assert JobRecord.from_dict(d.job.to_dict()) == d.job
    return d


def started(members: list[str], s: JobSpec, now: float = T0, restore: int | None = None):
    """A job whose generation 1 of `members` was just written (WARMUP)."""
    job = JobRecord.new(now - 10)
    job.next_generation = NextGeneration(members, "start")
    d = run(job, Snapshot(nodes(*members), restore_step=restore), s, now)
    assert d.job.state is JobState.WARMUP and d.job.generation == 1
    return d.job


def running(members: list[str], s: JobSpec, now: float = T0) -> JobRecord:
    job = started(members, s, now - 1)
    d = run(job, Snapshot(nodes(*members), statuses(1, NodeState.RUNNING, *members)), s, now)
    assert d.job.state is JobState.RUNNING
    return d.job


# -- PENDING --------------------------------------------------------------------------------------


def test_starts_when_enough_nodes_registered_then_writes_the_plan_next_tick():
    s = spec(spares=1)
    job = JobRecord.new(T0)
    few = Snapshot(nodes("node0", "node1"), preflight=passed("node0", "node1"))
    assert not run(job, few, s, T0 + 1).changed  # 2 of 2 + 1 spare: wait for the join timeout
    snap = Snapshot(nodes("node0", "node1", "node2"), preflight=passed("node0", "node1", "node2"))
    d = run(job, snap, s, T0 + 1)
    assert d.job.next_generation is not None and d.job.next_generation.members == [
        "node0",
        "node1",
    ]
    assert d.job.state is JobState.PENDING and d.plan is None
    snap.restore_step = None  # what the I/O loop read from the catalog for those members
    d = run(d.job, snap, s, T0 + 1.2)
    assert d.job.state is JobState.WARMUP and d.job.generation == 1
    assert d.plan is not None and d.plan.members == ["node0", "node1"]
    (generation,) = d.events
    assert generation.kind is EventKind.GENERATION and generation.spares == ["node2"]
    assert "resuming fresh" in generation.message


def test_starts_with_fewer_nodes_after_the_join_timeout():
    s = spec(nnodes_min=2, nnodes_max=3, join_timeout_s=30.0)
    snap = Snapshot(nodes("node0", "node1"), preflight=passed("node0", "node1"))
    assert run(JobRecord.new(T0), snap, s, T0 + 29).job.next_generation is None
    assert run(JobRecord.new(T0), snap, s, T0 + 31).job.next_generation is not None


def test_waits_for_preflight_results_then_excludes_failed_and_slow_nodes():
    s = spec(nnodes_min=2, nnodes_max=3, join_timeout_s=0.0)
    live = nodes("node0", "node1", "node2", "node3")
    some = passed("node0", "node1")
    assert not run(JobRecord.new(T0), Snapshot(live, preflight=some), s, T0 + 1).changed
    results = passed("node0", "node1", "node2") | {
        "node3": PreflightResult(False, T0, ["only 12 MiB of disk free"], 50.0)
    }
    results["node2"].compute_gflops = 10.0  # far below the median
    d = run(JobRecord.new(T0), Snapshot(live, preflight=results), s, T0 + 1)
    assert set(d.job.evicted) == {"node2", "node3"}
    assert "pre-flight check failed: only 12 MiB" in d.job.evicted["node3"].reason
    assert {e.node for e in d.events if e.kind is EventKind.EVICT} == {"node2", "node3"}
    assert d.job.next_generation is not None and d.job.next_generation.members == ["node0", "node1"]
    # without every result, start after PREFLIGHT_WAIT_S anyway
    late = run(JobRecord.new(T0), Snapshot(live, preflight=some), s, T0 + PREFLIGHT_WAIT_S)
    assert late.job.next_generation is not None


# -- WARMUP and RUNNING ---------------------------------------------------------------------------


def test_running_once_every_member_started_and_succeeded_when_all_finished():
    s = spec()
    job = started(["node0", "node1"], s)
    half = {"node0": status("node0", 1, NodeState.RUNNING)}
    assert not run(job, Snapshot(nodes("node0", "node1"), half), s, T0 + 1).changed
    job = running(["node0", "node1"], s, T0 + 1)
    done = statuses(1, NodeState.SUCCEEDED, "node0", "node1")
    d = run(job, Snapshot(nodes("node0", "node1"), done), s, T0 + 5)
    assert d.job.state is JobState.SUCCEEDED and kinds(d) == ["succeeded"]
    assert d.plan is not None and d.plan.job_state is JobState.SUCCEEDED


def test_warmup_timeout_is_an_incident_that_evicts_the_stuck_member():
    s = spec(warmup_timeout_s=60.0, nnodes_max=2, spares=1)
    job = started(["node0", "node1"], s)
    snap = Snapshot(
        nodes("node0", "node1", "node2"),
        {"node0": status("node0", 1, NodeState.RUNNING)},
        preflight=passed("node0", "node1", "node2"),
    )
    assert not run(job, snap, s, T0 + 59).changed
    d = run(job, snap, s, T0 + 61)
    assert d.job.state is JobState.RECOVERING and d.job.incident is not None
    assert d.job.incident.stuck == ["node1"]
    (incident,) = d.events
    assert incident.stuck == ["node1"] and "did not start workers within 60 s" in incident.message
    # a stuck member is a known cause: no need to wait for a report from it
    d = run(d.job, snap, s, T0 + 61 + s.settle_s)
    assert "node1" in d.job.evicted and d.job.next_generation is not None
    assert d.job.next_generation.members == ["node0", "node2"]


def test_recovering_is_committed_before_the_restart_writes_the_next_generation():
    s = spec(spares=1)
    job = running(["node0", "node1"], s)
    failed = {"node0": status("node0", 1, NodeState.FAILED, failures=[crash(0)])}
    snap = Snapshot(
        nodes("node0", "node1"), failed | {"node1": status("node1", 1, NodeState.RUNNING)}
    )
    d = run(job, snap, s, T0 + 2)
    assert d.job.state is JobState.RECOVERING and kinds(d) == ["incident"]
    assert d.plan is not None and d.plan.job_state is JobState.RECOVERING
    assert d.plan.generation == 1  # the agents keep the generation until the restart
    incident = d.events[0]
    assert incident.failed == ["node0"] and incident.lost == []


def test_failure_reports_that_are_not_valid_are_left_out_and_the_rest_diagnosed():
    """Statuses read back from etcd with junk among their failure reports: the controller
    diagnoses on the valid ones and never stops on the rest."""
    s = spec(settle_s=0.5)
    own = status("node0", 1, NodeState.FAILED, failures=[crash(0)]).to_dict()
    own["failures"] = ["junk", None, {"kind": "banana"}, {"rank": "0"}, *own["failures"]]
    bare = status("node1", 1, NodeState.FAILED).to_dict() | {"failures": [42, {"time": "x"}]}
    read = parse_all(NodeStatus, {"node0": own, "node1": bare})
    assert read["node0"].failures == [crash(0)] and read["node1"].failures == []
    live = nodes("node0", "node1")
    job = run(running(["node0", "node1"], s), Snapshot(live, read), s, T0 + 2).job
    d = run(job, Snapshot(live, read), s, T0 + 2.5)
    assert kinds(d)[0] == "diagnosis" and d.events[0].blamed == ["node0"]
    assert d.job.next_generation is not None


def test_a_thousand_node_generation_is_announced_in_a_short_message_naming_who_changed():
    members = [f"node{i}" for i in range(1024)]
    s = spec(nnodes_min=1024, nnodes_max=1024, spares=1)
    job = running(members, s)
    alive = nodes(*members[:-1], "node1024")  # node1023 lost, the spare registered
    snap = Snapshot(alive, statuses(1, NodeState.RUNNING, *members[:-1]))
    d = run(job, snap, s, T0 + 2)
    assert kinds(d) == ["incident"]
    d = run(d.job, snap, s, T0 + 2 + s.settle_s)  # the cause is known: after the settle time
    assert "diagnosis" in kinds(d) and d.job.next_generation is not None
    d = run(d.job, snap, s, T0 + 3 + s.settle_s)
    (generation,) = [e for e in d.events if e.kind is EventKind.GENERATION]
    assert generation.members == [*members[:-1], "node1024"]  # every name is in the record
    assert "1024 members node0, node1" in generation.message
    assert "(in node1024; out node1023)" in generation.message
    assert len(generation.message) < 200


def test_settle_waits_for_silent_members_unless_the_cause_is_known():
    s = spec(settle_s=0.5, node_ttl_s=10.0)
    live = nodes("node0", "node1")
    peer_only = {
        "node0": status("node0", 1, NodeState.FAILED, failures=[crash(0, peer_error=True)]),
        "node1": status("node1", 1, NodeState.RUNNING),
    }
    incident = run(running(["node0", "node1"], s), Snapshot(live, peer_only), s, T0 + 2)
    assert kinds(incident) == ["incident"] and incident.due == T0 + 2  # diagnosed next, at once
    job = incident.job
    # only a peer error so far: wait for node1's report (up to the lease time)
    waiting = run(job, Snapshot(live, peer_only), s, T0 + 3)
    assert waiting.job.next_generation is None
    assert waiting.due == T0 + 2 + s.node_ttl_s + 1.0  # the controller ticks then
    assert run(job, Snapshot(live, peer_only), s, T0 + 2 + 11.0).job.next_generation is not None
    # its own fault: diagnose after settle_s (the others may raise the same exception)
    own = peer_only | {"node0": status("node0", 1, NodeState.FAILED, failures=[_raised(0)])}
    waiting = run(job, Snapshot(live, own), s, T0 + 2.4)
    assert waiting.job.next_generation is None and waiting.due == T0 + 2 + s.settle_s
    d = run(job, Snapshot(live, own), s, T0 + 2.5)
    assert kinds(d)[0] == "diagnosis" and d.events[0].blamed == ["node0"]
    assert d.job.next_generation is not None and d.due == T0 + 2.5  # its plan: at once
    # a worker SIGKILLed: its node's fault whatever the others say, diagnosed at once
    killed = peer_only | {"node0": status("node0", 1, NodeState.FAILED, failures=[crash(0)])}
    d = run(job, Snapshot(live, killed), s, T0 + 2.01)
    assert kinds(d)[0] == "diagnosis" and d.events[0].blamed == ["node0"]
    assert d.job.next_generation is not None
    # ... but not a SIGABRT (a collective's watchdog aborts a rank that waited for a peer)
    aborted = replace(crash(0), signal="SIGABRT", exitcode=-6, describe="rank 0 SIGABRT")
    waiting = run(
        job,
        Snapshot(
            live, peer_only | {"node0": status("node0", 1, NodeState.FAILED, failures=[aborted])}
        ),
        s,
        T0 + 2.01,
    )
    assert waiting.job.next_generation is None and waiting.due == T0 + 2 + s.settle_s
    # every member reported: no wait at all
    both = own | {"node1": status("node1", 1, NodeState.FAILED, failures=[crash(1, True)])}
    assert run(job, Snapshot(live, both), s, T0 + 2.01).job.next_generation is not None


def test_a_silent_member_whose_peers_lost_their_workers_is_set_aside_for_a_spare():
    # node1's machine died: node0's and node2's workers failed on their peer; node1's agent
    # says nothing, and its lease holds for seconds yet. A spare (node3) takes its place.
    s = spec(nnodes_min=3, nnodes_max=3, spares=1, node_ttl_s=8.0)
    live = nodes("node0", "node1", "node2", "node3")
    peers = {
        n: status(n, 1, NodeState.FAILED, failures=[crash(i, peer_error=True)])
        for i, n in ((0, "node0"), (2, "node2"))
    } | {"node1": status("node1", 1, NodeState.RUNNING)}
    job = run(running(["node0", "node1", "node2"], s), Snapshot(live, peers), s, T0 + 2).job
    waiting = run(job, Snapshot(live, peers), s, T0 + 2 + SILENT_AGENT_S / 2)
    assert waiting.job.next_generation is None
    assert waiting.due == T0 + 2 + SILENT_AGENT_S  # not the lease's expiry (T0 + 11)
    d = run(job, Snapshot(live, peers), s, T0 + 2 + SILENT_AGENT_S)
    nxt = d.job.next_generation
    assert nxt is not None and nxt.members == ["node0", "node2", "node3"]
    assert nxt.lost == ["node1"]  # its memory tier is not relied on for the restore
    assert "node1" not in d.job.evicted  # set aside, not evicted
    assert any("node1 set aside" in e.message for e in d.events)
    # its agent was alive after all: it is a spare of the next generation
    d = run(d.job, Snapshot(live, peers), s, T0 + 2.1 + SILENT_AGENT_S, d.memory)
    started_gen = d.job
    assert started_gen.members == ["node0", "node2", "node3"]
    # no spare while its lease may be a dead node's (another incident would wait for it)
    assert Tick(started_gen, Snapshot(live, {}), s, T0 + 5, Memory()).spares([]) == [
        "node0",
        "node2",
        "node3",
    ]
    running_now = statuses(2, NodeState.RUNNING, "node0", "node2", "node3")
    # it lives on past a node TTL and the grace to register again: forgotten, a spare
    later = T0 + 2 + SILENT_AGENT_S + s.node_ttl_s + REREGISTER_MARGIN_S + 0.5
    kept = run(started_gen, Snapshot(live, running_now), s, later)
    assert not kept.job.set_aside and not kept.job.evicted
    tick = Tick(kept.job, Snapshot(live, {}), s, later, Memory())
    assert tick.spares(kept.job.members) == ["node1"]
    # or its lease expires: evicted as a lost node (a scheduler drains it, a refill replaces it)
    dead = Snapshot(nodes("node0", "node2", "node3"), running_now)
    d = run(started_gen, dead, s, T0 + 9)
    assert d.job.evicted["node1"].reason == LEASE_EXPIRED and not d.job.set_aside
    assert d.plan is not None and "node1" in d.plan.evicted
    assert d.job.state is JobState.RUNNING and d.job.restarts_used == started_gen.restarts_used
    # the job's members all finish before its lease expires: the job waits for the eviction
    # (else a dead machine would never be drained), at most until it would be forgotten
    finished = statuses(2, NodeState.SUCCEEDED, "node0", "node2", "node3")
    d = run(started_gen, Snapshot(live, finished), s, T0 + 6)
    assert not d.job.state.terminal and d.job.set_aside
    set_aside_at = started_gen.set_aside["node1"]
    assert d.due == set_aside_at + s.node_ttl_s + REREGISTER_MARGIN_S
    # alive after all: at that moment it is forgotten (a spare) and the job ends
    alive = run(started_gen, Snapshot(live, finished), s, d.due)
    assert not alive.job.set_aside and "node1" not in alive.job.evicted
    assert alive.job.state is JobState.SUCCEEDED
    d = run(started_gen, Snapshot(nodes("node0", "node2", "node3"), finished), s, T0 + 9)
    assert d.job.evicted["node1"].reason == LEASE_EXPIRED
    assert d.job.state is JobState.SUCCEEDED


def test_a_peer_that_failed_before_is_not_evicted_when_a_silent_member_is_set_aside():
    # node1's worker crashed 9 s ago (its failure is in the history); now node2's machine died
    # and node1's workers failed on it: the blame is node2's alone, as if its lease had expired
    s = spec(nnodes_min=3, nnodes_max=3, spares=1, node_ttl_s=8.0)
    job = running(["node0", "node1", "node2"], s)
    job.failures = {"node1": [T0 - 7]}
    live = nodes("node0", "node1", "node2", "node3")
    first = replace(crash(1, peer_error=True), time=T0 - 0.1)  # node1 reported first
    peers = {
        "node0": status("node0", 1, NodeState.FAILED, failures=[crash(0, peer_error=True)]),
        "node1": status("node1", 1, NodeState.FAILED, failures=[first]),
        "node2": status("node2", 1, NodeState.RUNNING),
    }
    job = run(job, Snapshot(live, peers), s, T0 + 2).job
    d = run(job, Snapshot(live, peers), s, T0 + 2 + SILENT_AGENT_S)
    assert d.job.state is JobState.RECOVERING and not d.job.evicted, d.events
    nxt = d.job.next_generation
    assert nxt is not None and nxt.members == ["node0", "node1", "node3"]


def test_setting_aside_never_ends_the_job_for_want_of_nodes():
    # another member is evicted in the same restart and the one spare cannot cover both: the
    # silent member stays a member (its lease decides), the job does not fail
    s = spec(nnodes_min=3, nnodes_max=3, spares=1, node_ttl_s=8.0)
    job = running(["node0", "node1", "node2"], s)
    live = nodes("node0", "node1", "node2", "node3")
    tick = Tick(job, Snapshot(live, {}), s, T0 + 3, Memory())
    tick.restart({"node0": "pre-flight check failed"}, "test", ["node2"])
    assert tick.job.state is not JobState.FAILED and not tick.job.set_aside
    assert tick.job.next_generation is not None
    assert tick.job.next_generation.members == ["node1", "node2", "node3"]


def test_a_silent_member_is_waited_for_when_no_spare_can_take_its_place():
    # the same, without a spare: setting node1 aside would shrink the job, so its lease decides
    s = spec(nnodes_min=3, nnodes_max=3, spares=0, node_ttl_s=8.0)
    live = nodes("node0", "node1", "node2")
    peers = {
        n: status(n, 1, NodeState.FAILED, failures=[crash(i, peer_error=True)])
        for i, n in ((0, "node0"), (2, "node2"))
    } | {"node1": status("node1", 1, NodeState.RUNNING)}
    job = run(running(["node0", "node1", "node2"], s), Snapshot(live, peers), s, T0 + 2).job
    d = run(job, Snapshot(live, peers), s, T0 + 2 + SILENT_AGENT_S)
    assert d.job.next_generation is None and d.due == T0 + 2 + s.node_ttl_s + 1.0


def _raised(rank: int) -> FailureReport:
    return replace(crash(rank), exitcode=1, signal=None, signature="ValueError: bad value")


def _diagnosed_on_node0_alone(s: JobSpec) -> tuple[dict, dict, Decision]:
    """node0 raised the error, node1 still runs; settle_s later: diagnosed on node0's report."""
    live = nodes("node0", "node1")
    early = {
        "node0": status("node0", 1, NodeState.FAILED, failures=[_raised(0)]),
        "node1": status("node1", 1, NodeState.RUNNING),
    }
    job = run(running(["node0", "node1"], s), Snapshot(live, early), s, T0 + 2).job
    d = run(job, Snapshot(live, early), s, T0 + 2.5)
    assert kinds(d)[0] == "diagnosis" and d.job.last_signature is None
    return live, early, d


def test_a_members_same_error_reported_after_the_diagnosis_still_makes_the_job_fail_fast():
    """Every rank raises the same error, but node1's workers start later: the first diagnosis
    is made on node0's report alone. node1's report that follows still counts, so the second
    time the job fails fast instead of evicting node0 for failing again."""
    s = spec(settle_s=0.5, max_restarts=10)
    live, early, d = _diagnosed_on_node0_alone(s)
    late = early | {"node1": status("node1", 1, NodeState.FAILED, failures=[_raised(1)])}
    d = run(d.job, Snapshot(live, late), s, T0 + 2.6, d.memory)
    assert d.job.last_signature == "ValueError: bad value" and d.memory.diagnosed is None
    d = run(d.job, Snapshot(live, late), s, T0 + 2.7, d.memory)
    assert d.job.generation == 2
    again = {
        "node0": status("node0", 2, NodeState.FAILED, failures=[_raised(0)]),
        "node1": status("node1", 2, NodeState.RUNNING),
    }
    d = run(d.job, Snapshot(live, again), s, T0 + 5, d.memory)
    d = run(d.job, Snapshot(live, again), s, T0 + 5.5, d.memory)
    assert d.job.state is JobState.FAILED and "same error twice" in d.job.reason


def test_the_same_error_raised_by_each_member_in_turn_fails_fast():
    """CI's run: each generation, the node whose interpreter was still importing torch had not
    raised yet when the diagnosis ended it; node1, then node0 raised the error: every rank has
    raised it, and after a restart, so the second generation's failure ends the job."""
    s = spec(settle_s=0.5, max_restarts=10)
    live, d, now = nodes("node0", "node1"), None, T0 + 2
    job = running(["node0", "node1"], s)
    for generation, (first, rank) in enumerate([("node1", 1), ("node0", 0)], 1):
        slow = "node0" if first == "node1" else "node1"
        reports = {
            first: status(first, generation, NodeState.FAILED, failures=[_raised(rank)]),
            slow: status(slow, generation, NodeState.RUNNING),
        }
        for dt in (0.0, 0.5, 0.7):  # the report, the diagnosis after settle_s, the next start
            d = run(job, Snapshot(live, reports), s, now + dt, d.memory if d else None)
            job = d.job
            if job.state.terminal:
                break
        now += 2.0
    assert d is not None and job.state is JobState.FAILED, job.reason
    assert job.generation == 2 and job.restarts_used == 1 and "same error twice" in job.reason


def test_a_late_report_of_another_error_or_a_signal_is_no_common_error():
    s = spec(settle_s=0.5)
    live, early, d = _diagnosed_on_node0_alone(s)
    for failure in (crash(1), replace(_raised(1), signature="KeyError: 'x'")):
        late = early | {"node1": status("node1", 1, NodeState.FAILED, failures=[failure])}
        after = run(d.job, Snapshot(live, late), s, T0 + 2.6, d.memory)
        assert after.job.last_signature is None and after.memory.diagnosed is not None


def test_a_lost_node_is_evicted_and_a_spare_takes_its_place():
    s = spec(spares=1, settle_s=0.5)
    job = running(["node0", "node1"], s)
    after = Snapshot(
        nodes("node0", "node2"),
        statuses(1, NodeState.RUNNING, "node0"),
        preflight=passed("node0", "node1", "node2"),
    )
    d = run(job, after, s, T0 + 2)
    assert d.events[0].lost == ["node1"] and d.job.state is JobState.RECOVERING
    d = run(d.job, after, s, T0 + 2.5)
    assert kinds(d) == ["diagnosis", "evict", "spare"]
    assert d.events[0].lost == ["node1"] and d.events[1].lost == ["node1"]
    assert d.events[2].node == "node2"
    nxt = d.job.next_generation
    assert nxt is not None and nxt.members == ["node0", "node2"] and nxt.lost == ["node1"]
    assert d.job.restarts_used == 1
    after.restore_step = 40
    d = run(d.job, after, s, T0 + 2.7)
    assert d.job.generation == 2 and d.job.restore_step == 40 and d.plan is not None
    assert d.plan.restore_step == 40 and d.plan.evicted.keys() == {"node1"}
    assert "restart 1 of 2" in d.events[0].message and "from step 40" in d.events[0].message


def test_not_enough_nodes_left_fails_the_job():
    s = spec(settle_s=0.0)
    job = running(["node0", "node1"], s)
    alone = Snapshot(nodes("node0"), statuses(1, NodeState.RUNNING, "node0"))
    d = run(run(job, alone, s, T0 + 2).job, alone, s, T0 + 2.1)
    assert d.job.state is JobState.FAILED and "not enough nodes: 1 healthy" in d.job.reason
    assert d.plan is not None and d.plan.job_state is JobState.FAILED


def _fail_and_restart(job: JobRecord, s: JobSpec, now: float) -> JobRecord:
    """node0's worker fails by itself in the current generation; recover up to the next plan."""
    g = job.generation
    snap = Snapshot(
        nodes("node0", "node1"),
        {
            "node0": status("node0", g, NodeState.FAILED, failures=[crash(0)]),
            "node1": status("node1", g, NodeState.FAILED, failures=[crash(1, True)]),
        },
    )
    job = run(job, snap, s, now).job
    assert job.state is JobState.RECOVERING
    job = run(job, snap, s, now + 0.1).job
    if job.state is JobState.FAILED:
        return job
    assert job.next_generation is not None
    return run(job, snap, s, now + 0.2).job


def test_one_restart_per_incident_and_failed_when_the_budget_is_spent():
    s = spec(max_restarts=1, evict_window_s=0.0)
    job = running(["node0", "node1"], s)
    job = _fail_and_restart(job, s, T0 + 10)
    assert job.restarts_used == 1 and job.incident_open and job.generation == 2
    # generation 2 fails before it ever ran: the same incident, not charged again
    job = _fail_and_restart(job, s, T0 + 20)
    assert job.restarts_used == 1 and job.state is JobState.WARMUP and job.generation == 3
    # generation 3 runs: the incident is over
    up = Snapshot(nodes("node0", "node1"), statuses(3, NodeState.RUNNING, "node0", "node1"))
    job = run(job, up, s, T0 + 30).job
    assert job.state is JobState.RUNNING and not job.incident_open
    # a new incident needs a new restart, and the budget is spent
    job = _fail_and_restart(job, s, T0 + 40)
    assert job.state is JobState.FAILED and "restart budget spent" in job.reason


def _nan(node: str, step: int, at: float, generation: int = 1) -> Anomaly:
    return Anomaly(
        "nan",
        Severity.CRITICAL,
        f"loss is nan at step {step}",
        [node],
        [0],
        time=at,
        step=step,
        id=f"{node}-{step}",
        generation=generation,
    )


def _summary(node: str, generation: int, t: float, *anomalies: Anomaly) -> MonitorSummary:
    return MonitorSummary(node, generation, t, anomalies=list(anomalies))


def test_rollback_is_recorded_then_cleared_with_a_discard_once_the_next_generation_trains():
    s = spec()
    job = running(["node0", "node1"], s)
    live = nodes("node0", "node1")
    up = statuses(1, NodeState.RUNNING, "node0", "node1")
    summaries = {
        "node0": _summary("node0", 1, T0 + 5, _nan("node0", 31, T0 + 5)),
        "node1": _summary("node1", 1, T0 + 5, _nan("node1", 30, T0 + 5.1)),
    }
    snap = Snapshot(live, up, summaries)
    held = run(job, snap, s, T0 + 5.2)  # NaN reports are held for a moment: the earliest wins
    assert held.job.state is JobState.RUNNING and held.job.rollback_before is None
    assert held.due == T0 + 5.2 + NUMERICS_SETTLE_S  # the tick that decides: then, not later
    d = run(job, snap, s, T0 + 6, held.memory)  # held from when the controller first saw them
    assert kinds(d) == ["decision", "rollback", "incident"]
    assert d.job.rollback_before == 30 and d.job.numerics_steps == [30]
    assert d.job.state is JobState.RECOVERING and d.job.next_generation is not None
    assert set(d.job.handled_anomalies) == {"node0-31", "node1-30"}
    assert [a.id for a in d.anomalies] == ["node1-30"]
    snap.restore_step = 20  # the I/O loop asked the catalog for a step before 30
    d = run(d.job, snap, s, T0 + 6.2)
    assert d.job.generation == 2 and d.plan is not None and d.plan.restore_step == 20
    assert d.plan.restore_before == 30  # the ranks may agree on a newer step, never on 30
    assert d.job.rollback_before == 30 and d.discard_poisoned is None
    up2 = statuses(2, NodeState.RUNNING, "node0", "node1")
    d = run(d.job, Snapshot(live, up2), s, T0 + 9)
    # Running, but no rank has finished a step: its ranks may still be loading step 29. (What
    # generation 1 left pending, a fresh start's "anything saved before it", is applied now.)
    assert d.job.state is JobState.RUNNING and d.discard_poisoned == (0, 1)
    assert d.job.rollback_before == 30  # a restart meanwhile still restores below 30
    trained = {"node0": MonitorSummary("node0", 2, T0 + 9.5, ranks={"0": RankSummary(step=30)})}
    d = run(d.job, Snapshot(live, up2, trained), s, T0 + 10)
    assert d.discard_poisoned == (21, 2)  # after the plan's step 20, saved before generation 2
    assert d.job.rollback_before is None and d.job.discard_from is None
    assert run(d.job, Snapshot(live, up2, trained), s, T0 + 11).discard_poisoned is None  # once


def _two_nodes_with_a_nan() -> tuple[JobSpec, JobRecord, dict, dict, Anomaly]:
    """A running job of node0 (rank 0) and node1 (rank 1), and rank 0's NaN at step 31."""
    s = spec()
    first = _nan("node0", 31, T0 + 5)
    first.ranks = [0]
    up = statuses(1, NodeState.RUNNING, "node0", "node1")
    return s, running(["node0", "node1"], s), nodes("node0", "node1"), up, first


def test_nan_reports_are_decided_as_soon_as_every_rank_has_reported_one():
    s, job, live, up, first = _two_nodes_with_a_nan()
    summaries = {"node0": _summary("node0", 1, T0 + 5, first)}
    held = run(job, Snapshot(live, up, summaries), s, T0 + 5.1)
    assert held.job.rollback_before is None  # rank 1 has not said yet: its step may be earlier
    second = _nan("node1", 30, T0 + 5.1)
    second.ranks = [1]
    summaries["node1"] = _summary("node1", 1, T0 + 5.1, second)
    d = run(job, Snapshot(live, up, summaries), s, T0 + 5.2, held.memory)
    assert kinds(d) == ["decision", "rollback", "incident"]  # at once, not at T0 + 5.6
    assert d.job.rollback_before == 30
    forged = _nan("node1", 30, T0 + 5.1)
    forged.ranks = [7]  # a rank outside the world counts for nobody
    summaries["node1"] = _summary("node1", 1, T0 + 5.1, forged)
    assert run(job, Snapshot(live, up, summaries), s, T0 + 5.2).job.rollback_before is None


def test_nan_reports_are_decided_at_once_when_every_other_rank_finished_the_step_before():
    # The demo's NaN rank holds its peers in the all-reduce: they never report a NaN, but their
    # nodes' summaries say they finished the step before, so none of theirs can be earlier.
    s, job, live, up, first = _two_nodes_with_a_nan()

    def decided(node1_step: int, speaker: str = "node1") -> bool:
        summaries = {"node0": _summary("node0", 1, T0 + 5, first)}
        other = MonitorSummary(speaker, 1, T0 + 5, ranks={"1": RankSummary(step=node1_step)})
        if speaker == "node0":
            other.anomalies = [first]
        summaries[speaker] = other
        d = run(job, Snapshot(live, up, summaries), s, T0 + 5.1)
        return d.job.rollback_before is not None

    assert decided(30)  # rank 1 is past step 30 without a NaN: the earliest is 31's
    assert not decided(29)  # rank 1 may still report one at step 30
    assert not decided(30, speaker="node0")  # node0 cannot speak for node1's rank


def test_a_held_nan_asks_every_member_for_a_fresh_summary_once():
    # Rank 1's summary is from before the NaN: it may still report an earlier one. The hold
    # asks the members for their newest steps now (their keep-alive may be seconds away).
    s, job, live, up, first = _two_nodes_with_a_nan()
    stale = MonitorSummary("node1", 1, T0 + 4, ranks={"1": RankSummary(step=27)})
    summaries = {"node0": _summary("node0", 1, T0 + 5, first), "node1": stale}
    held = run(job, Snapshot(live, up, summaries), s, T0 + 5.1)
    assert held.job.rollback_before is None
    assert held.ask == SummaryRequest(generation=1, id=first.id)
    again = run(job, Snapshot(live, up, summaries), s, T0 + 5.2, held.memory)
    assert again.ask is None and again.job.rollback_before is None  # asked once per NaN
    summaries["node1"] = MonitorSummary("node1", 1, T0 + 5.2, ranks={"1": RankSummary(step=31)})
    summaries["node1"].answers = first.id
    d = run(job, Snapshot(live, up, summaries), s, T0 + 5.25, again.memory)
    assert d.job.rollback_before == 31 and d.ask is None  # the answer decides it, at once


def test_a_running_generation_forgets_the_steps_after_its_restore_step_saved_before_it():
    # An abandoned history (a generation that saved steps 15 and 18 and then lost a node before
    # they were complete) must never mix with the steps 15 and 18 this generation saves again.
    s = spec()
    job = started(["node0", "node1"], s, T0, restore=12)
    d = run(job, Snapshot(nodes("node0", "node1"), statuses(1, NodeState.RUNNING, "node0")), s, T0)
    assert d.job.state is JobState.WARMUP and d.discard_poisoned is None  # node1 not started
    both = statuses(1, NodeState.RUNNING, "node0", "node1")
    d = run(d.job, Snapshot(nodes("node0", "node1"), both), s, T0 + 1)
    assert d.job.state is JobState.RUNNING and d.discard_poisoned is None  # no step seen yet
    # A script whose steps the monitor never sees: after DISCARD_AFTER_S all the same.
    d = run(d.job, Snapshot(nodes("node0", "node1"), both), s, T0 + DISCARD_AFTER_S)
    assert d.discard_poisoned == (13, d.job.generation)
    fresh = run(started(["node0", "node1"], s, T0), Snapshot(nodes("node0", "node1"), both), s, T0)
    fresh = run(fresh.job, Snapshot(nodes("node0", "node1"), both), s, T0 + DISCARD_AFTER_S)
    assert fresh.discard_poisoned == (0, fresh.job.generation)  # a fresh start: all of it


def test_a_discard_a_generation_left_pending_is_applied_when_the_next_one_runs():
    # Generation 1 starts fresh (everything saved before it is an abandoned history) and fails
    # before the controller sees it train; generation 2 restores its step 4. The discard of the
    # abandoned history must not be lost (a restore could take it up again): it is applied as
    # generation 1 set it when generation 2 runs, and generation 2's own waits for its training.
    s = spec(evict_window_s=0.0)
    job = running(["node0", "node1"], s)
    assert (job.discard_from, job.discard_generation) == (0, 1)
    snap = Snapshot(
        nodes("node0", "node1"),
        {
            "node0": status("node0", 1, NodeState.FAILED, failures=[crash(0)]),
            "node1": status("node1", 1, NodeState.FAILED, failures=[crash(1, True)]),
        },
        restore_step=4,
    )
    job = run(job, snap, s, T0 + 10).job
    job = run(job, snap, s, T0 + 10.1).job
    job = run(job, snap, s, T0 + 10.2).job
    assert job.generation == 2 and job.restore_step == 4
    up = Snapshot(nodes("node0", "node1"), statuses(2, NodeState.RUNNING, "node0", "node1"))
    d = run(job, up, s, T0 + 11)
    assert d.job.state is JobState.RUNNING and d.discard_poisoned == (0, 1)
    assert (d.job.discard_from, d.job.discard_generation) == (5, 2)


def test_warnings_are_given_once_per_generation_and_kept_in_memory():
    s = spec()
    job = running(["node0", "node1"], s)
    spike = Anomaly("loss_spike", Severity.WARNING, "spike", ["node0"], id="a1", generation=1)
    again = Anomaly("loss_spike", Severity.WARNING, "spike", ["node0"], id="a2", generation=1)
    live, up = nodes("node0", "node1"), statuses(1, NodeState.RUNNING, "node0", "node1")
    d = run(job, Snapshot(live, up, {"node0": _summary("node0", 1, T0 + 3, spike)}), s, T0 + 3)
    assert kinds(d) == ["warning"] and d.events[0].anomaly_type == "loss_spike"
    snap = Snapshot(live, up, {"node0": _summary("node0", 1, T0 + 4, spike, again)})
    d2 = run(d.job, snap, s, T0 + 4, d.memory)
    assert kinds(d2) == [] and d2.changed  # handled (recorded), but not warned again
    assert d2.job.handled_anomalies == ["a1", "a2"]
    assert d.memory is not d2.memory and not Memory().warned


def test_a_new_leader_continuing_from_the_stored_record_decides_the_same():
    s = spec(spares=1, settle_s=0.5)
    job = running(["node0", "node1"], s)
    after = Snapshot(
        nodes("node0", "node2"),
        statuses(1, NodeState.RUNNING, "node0"),
        preflight=passed("node0", "node1", "node2"),
    )
    job = run(job, after, s, T0 + 2).job
    stored = job.to_dict()  # what the old leader committed before it died
    ours = run(job, after, s, T0 + 2.6)
    theirs = run(JobRecord.from_dict(stored), after, s, T0 + 2.6, Memory())
    assert theirs.job == ours.job and theirs.plan == ours.plan
    assert [e.to_dict() for e in theirs.events] == [e.to_dict() for e in ours.events]


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED])
def test_an_ended_job_decides_nothing(state):
    job = JobRecord(state, 3, ["node0"], T0)
    assert not run(job, Snapshot(nodes("node0")), spec(), T0 + 1).changed


@pytest.mark.integration
def test_the_report_imports_neither_the_controller_nor_the_etcd_client():
    code = (
        "import sys, transom.report, transom.report.analysis, transom.report.rundir\n"
        "bad = [m for m in ('transom.control.controller', 'etcd3gw', 'transom.store') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_registered_cluster_detector_is_run_each_tick_and_its_anomaly_goes_to_the_policy(
    monkeypatch,
):
    """A new cross-node detector is one class plus one line in `cluster.REGISTERED`."""
    from transom.monitor import cluster

    seen: list[cluster.ClusterView] = []

    class SlowLinkDetector:  # what a new file would hold
        def update(self, view: cluster.ClusterView) -> Anomaly | None:
            seen.append(view)
            return Anomaly("slow_link", Severity.WARNING, "node1's link is slow", ["node1"])

    monkeypatch.setattr(cluster, "REGISTERED", [*cluster.REGISTERED, SlowLinkDetector])
    s = spec()
    job = running(["node0", "node1"], s)
    live, up = nodes("node0", "node1"), statuses(1, NodeState.RUNNING, "node0", "node1")
    d = run(job, Snapshot(live, up, {"node0": _summary("node0", 1, T0 + 3)}), s, T0 + 3)
    assert seen[-1].now == T0 + 3 and seen[-1].hang_floor_s == s.hang_floor_s
    assert kinds(d) == ["anomaly", "warning"]
    assert d.events[0].type == "slow_link" and d.events[1].nodes == ["node1"]
    # observed on the controller's clock, never after the events that answer it (the report
    # credits a decision only if it comes at or after the detection)
    assert d.events[0].to_dict()["observed"] == T0 + 3 <= d.events[1].time
