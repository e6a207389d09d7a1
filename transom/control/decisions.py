"""The controller's rules: one tick of the job's state machine as a pure function.

`decide(job, snapshot, spec, now, memory)` reads the job record and a snapshot of what the
agents published (read by the controller's I/O loop) and returns the new job record, the plan
to write (if it changed), the events, and the side effects the I/O loop must perform (forget
poisoned checkpoints, count anomalies). It never touches etcd, processes or the clock, so each
rule is unit-tested on its own (tests/test_decisions.py); incidents are diagnosed by
transom.control.policy. The monitor's part (anomalies -> actions) is in `control.monitor_rules`.

A generation starts in two ticks: the tick that decides it records `job.next_generation`
(members, why); the I/O loop then reads the newest restorable checkpoint step for it from the
catalog into the snapshot, and the next tick, at once, writes the plan. So an incident is
committed as RECOVERING (visible to `transom status` and the event log) before its restart is.

Control-plane incidents (transom.control.grace) are told from node deaths here too: members
whose leases vanished because etcd itself stalled are given time to register again.
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass, field
from typing import TypeVar

from transom.common.names import listing, natural_key
from transom.common.records import (
    Anomaly,
    Event,
    EventKind,
    Eviction,
    Incident,
    JobRecord,
    MonitorSummary,
    NextGeneration,
    NodeRegistration,
    NodeStatus,
    Plan,
    PreflightResult,
)
from transom.common.states import JobState, NodeState
from transom.control.grace import excused_lost, lift_evictions
from transom.control.monitor_rules import watch_monitor
from transom.control.policy import SameError, diagnose, same_error, slow_outliers
from transom.job_spec import JobSpec
from transom.monitor import cluster

T = TypeVar("T")

# How long to wait for a node's pre-flight result before starting without comparing it.
PREFLIGHT_WAIT_S = 30.0

# How a FAILED job that ran out of nodes says so (a scheduler may give it new ones: requeue).
REASON_NOT_ENOUGH_NODES = "not enough nodes"


@dataclass
class Snapshot:
    """What the agents published, read once per tick by the I/O loop."""

    # live nodes (their lease holds), with their registration (None: not a valid record)
    nodes: dict[str, NodeRegistration | None]
    statuses: dict[str, NodeStatus] = field(default_factory=dict)
    summaries: dict[str, MonitorSummary] = field(default_factory=dict)  # the members'
    preflight: dict[str, PreflightResult] = field(default_factory=dict)
    # The newest checkpoint step every rank of `job.next_generation` can restore (None: fresh);
    # read from the checkpoint catalog only when a next generation is pending.
    restore_step: int | None = None
    # Measured by the controller on its own clock (transom.control.observed): seconds since it
    # saw each member's summary change; its newest gap in reaching etcd and how long ago it
    # ended (None: no gap seen).
    summary_ages: dict[str, float] = field(default_factory=dict)
    store_gap_s: float = 0.0
    since_store_gap_s: float | None = None


@dataclass
class Memory:
    """Detector state the controller keeps in memory only (a new leader starts it afresh)."""

    generation: int = 0
    detectors: list[cluster.ClusterDetector] = field(default_factory=cluster.fresh)
    warned: set[tuple[str, tuple]] = field(default_factory=set)  # (type, nodes) warned about
    first_seen: dict[str, float] = field(default_factory=dict)  # anomaly id -> first seen (now)
    # A control-plane incident (grace.py): until when lost members may register again, why.
    grace_until: float | None = None
    grace_reason: str = ""
    lost_before: set[str] = field(default_factory=set)  # members lost at the previous tick
    # The evidence that the script itself raises after the newest diagnosis (policy.SameError),
    # and that diagnosis while the evidence does not cover every member (generation, members,
    # failure reports, the evidence before it): a member whose own failure is reported only
    # after the diagnosis (its workers started later) may still complete "the same error on
    # every rank".
    same_error: SameError | None = None
    diagnosed: tuple[int, list[str], dict[str, NodeStatus], SameError | None] | None = None


@dataclass
class Decision:
    """One tick's outcome."""

    job: JobRecord
    plan: Plan | None = None  # write it (None: the plan is unchanged)
    events: list[Event] = field(default_factory=list)
    memory: Memory = field(default_factory=Memory)
    # Forget checkpoints of steps >= [0] saved since [1] (the workers that went bad are gone).
    discard_poisoned: tuple[int, int] | None = None  # (first bad step, first generation kept)
    anomalies: list[Anomaly] = field(default_factory=list)  # newly handled, for the exporter
    # When (`now`'s clock) the next tick is due, sooner than the controller's TICK_S if need be:
    # at once when a generation was decided (its plan follows), or when a rule that waits now
    # decides (an incident's settle time). None: when something changes or the timer runs out.
    due: float | None = None

    changed: bool = False  # something to commit (the record, the plan or events)


def decide(
    job: JobRecord, snapshot: Snapshot, spec: JobSpec, now: float, memory: Memory | None = None
) -> Decision:
    """The job's next step; `job` and `memory` are not modified (the Decision holds new ones)."""
    tick = Tick(_copy(job), snapshot, spec, now, _copy(memory or Memory()))
    state = tick.job.state
    if not state.terminal:
        lift_evictions(tick)
        tick.take_late_failures()
    if state.terminal:
        pass
    elif tick.job.next_generation is not None:
        tick.start_next_generation()
    elif state is JobState.PENDING:
        tick.pending()
    elif state in (JobState.WARMUP, JobState.RUNNING):
        tick.watch_generation()
        if tick.job.state is JobState.RUNNING:
            watch_monitor(tick)
    elif state is JobState.RECOVERING:
        tick.recover()
    d = tick.decision
    if tick.job.next_generation is not None and not tick.job.state.terminal:
        d.due = now  # its plan: at once (the module doc)
    d.changed = d.plan is not None or bool(d.events) or d.job != job
    return d


def _changes(before: list[str], after: list[str]) -> str:
    """Who joined and who left between two generations' members, for a message ("" if none)."""
    was, now = set(before), set(after)
    joined = [m for m in after if m not in was]
    left = [m for m in before if m not in now]
    parts = [f"{what} {listing(names)}" for what, names in (("in", joined), ("out", left)) if names]
    return f" ({'; '.join(parts)})" if parts and before else ""


def _copy(value: T) -> T:
    """A deep copy of plain records and detector state, through pickle: several times faster
    than copy.deepcopy on a thousand nodes' detector windows, and the same result for them. The
    bytes never leave this process (nothing read from outside is ever unpickled). A registered
    detector pickle cannot take (a class defined in a function) is copied by copy.deepcopy."""
    try:
        return pickle.loads(pickle.dumps(value, pickle.HIGHEST_PROTOCOL))
    except (pickle.PicklingError, AttributeError, TypeError):
        return copy.deepcopy(value)


class Tick:
    """The working state of one `decide` call; its methods are the rules."""

    def __init__(
        self, job: JobRecord, snap: Snapshot, spec: JobSpec, now: float, memory: Memory
    ) -> None:
        self.job, self.snap, self.spec, self.now = job, snap, spec, now
        self.decision = Decision(job, memory=memory)

    # -- outputs --------------------------------------------------------------------------------
    def event(self, kind: EventKind, message: str, **fields) -> None:
        # Distinct times keep the events' keys distinct and in order within one commit.
        at = self.now + len(self.decision.events) * 1e-6
        fields.setdefault("generation", self.job.generation)
        self.decision.events.append(Event(at, kind, message, **fields))

    def write_plan(self) -> None:
        j = self.job
        self.decision.plan = Plan(
            j.generation, list(j.members), j.state, dict(j.evicted), j.restarts_used, j.restore_step
        )

    def set_state(self, state: JobState, reason: str) -> None:
        self.job.state, self.job.reason = state, reason

    def finish(self, state: JobState, reason: str) -> None:
        self.set_state(state, reason)
        self.event(EventKind(state.value.lower()), reason)
        self.write_plan()

    # -- helpers --------------------------------------------------------------------------------
    def healthy_nodes(self) -> list[str]:
        return sorted((n for n in self.snap.nodes if n not in self.job.evicted), key=natural_key)

    def spares(self, members: list[str]) -> list[str]:
        """The healthy nodes outside `members` (a set: a thousand nodes are looked up)."""
        taken = set(members)
        return [n for n in self.healthy_nodes() if n not in taken]

    def reports(self, state: NodeState) -> dict[str, NodeStatus]:
        """The members' statuses of the current generation in `state`."""
        s, g = self.snap.statuses, self.job.generation
        return {
            m: s[m]
            for m in self.job.members
            if m in s and s[m].generation == g and s[m].state is state
        }

    def lost(self) -> list[str]:
        """Members whose lease is gone, less those excused by a control-plane incident."""
        return excused_lost(self, [m for m in self.job.members if m not in self.snap.nodes])

    def evict(self, node: str, reason: str, message: str, **fields) -> None:
        known = self.snap.nodes.get(node) or self.snap.statuses.get(node)
        incarnation = known.incarnation if known is not None else ""
        self.job.evicted[node] = Eviction(reason, self.now, self.job.generation, incarnation)
        self.event(EventKind.EVICT, message, node=node, **fields)

    # -- PENDING: wait for nodes ----------------------------------------------------------------
    def pending(self) -> None:
        spec = self.spec
        waited = self.now - self.job.since
        checked = self.snap.preflight
        if any(n not in checked for n in self.healthy_nodes()) and waited < PREFLIGHT_WAIT_S:
            return  # the job's warm-up: every node's pre-flight result first
        self.exclude_outliers()
        healthy = self.healthy_nodes()
        if len(healthy) >= spec.nnodes_max + spec.spares or (
            len(healthy) >= spec.nnodes_min and waited >= spec.join_timeout_s
        ):
            self.job.next_generation = NextGeneration(healthy[: spec.nnodes_max], "start")

    def exclude_outliers(self, keep: list[str] | tuple = ()) -> None:
        """Evict nodes (but not those in `keep`) that failed pre-flight or are far below peers."""
        results = {
            n: r
            for n, r in self.snap.preflight.items()
            if n in self.snap.nodes and n not in self.job.evicted
        }
        excluded = {
            n: "pre-flight check failed: " + "; ".join(r.problems)
            for n, r in results.items()
            if not r.passed
        }
        excluded.update({n: why for n, why in slow_outliers(results).items() if n not in excluded})
        for node, reason in excluded.items():
            if node not in keep:
                self.evict(
                    node,
                    reason,
                    f"{node} excluded before training: {reason}",
                    preflight=results[node].to_dict(),
                )

    # -- a new generation -----------------------------------------------------------------------
    def start_next_generation(self) -> None:
        j, nxt = self.job, self.job.next_generation
        assert nxt is not None
        j.next_generation = None
        j.restore_step = self.snap.restore_step
        j.generation += 1
        before, j.members = j.members, nxt.members
        self.set_state(JobState.WARMUP, f"generation {j.generation} starting")
        j.generation_started = self.now
        j.handled_anomalies = []
        spares = self.spares(j.members)
        restore = "fresh" if j.restore_step is None else f"from step {j.restore_step}"
        self.event(
            EventKind.GENERATION,
            f"generation {j.generation} ({nxt.why}): {len(j.members)} members "
            f"{listing(j.members)}{_changes(before, j.members)}; "
            f"spares {listing(spares) or 'none'}; resuming {restore}",
            members=j.members,
            spares=spares,
            restore_step=j.restore_step,
        )
        self.write_plan()

    # -- WARMUP and RUNNING ---------------------------------------------------------------------
    def watch_generation(self) -> None:
        j, spec = self.job, self.spec
        lost = self.lost()
        failed = self.reports(NodeState.FAILED)
        stuck: list[str] = []
        started_at = j.generation_started if j.generation_started is not None else self.now
        if j.state is JobState.WARMUP and self.now - started_at > spec.warmup_timeout_s:
            running = self.reports(NodeState.RUNNING)
            stuck = [m for m in j.members if m not in running]
        if lost or failed or stuck:
            what = (
                [f"{m} lost" for m in lost]
                + [f"{m} reported a failure" for m in failed]
                + [f"{m} did not start workers within {spec.warmup_timeout_s:.0f} s" for m in stuck]
            )
            j.incident = Incident(self.now, j.generation, stuck)
            self.set_state(JobState.RECOVERING, "; ".join(what))
            self.event(
                EventKind.INCIDENT,
                "; ".join(what),
                lost=lost,
                failed=sorted(failed),
                stuck=stuck,
                detection=self.now,
            )
            self.write_plan()
            return
        if len(self.reports(NodeState.SUCCEEDED)) == len(j.members):
            self.finish(
                JobState.SUCCEEDED, f"all {len(j.members)} nodes finished generation {j.generation}"
            )
            return
        if j.state is JobState.WARMUP:
            started = self.reports(NodeState.RUNNING) | self.reports(NodeState.SUCCEEDED)
            if len(started) == len(j.members):
                # The incident that led here is over: the next one is charged a restart again.
                j.incident_open = False
                # Every old worker is stopped now. Shards of steps after the one this generation
                # restored, saved by an earlier generation, belong to an abandoned history (a
                # generation that went on past the restore step, maybe with another world size,
                # or went bad before a rollback): forget them on every tier, so they never mix
                # with the same steps this generation saves again. Later restarts restore the
                # newest again.
                first_stale = 0 if j.restore_step is None else j.restore_step + 1
                self.decision.discard_poisoned = (first_stale, j.generation)
                j.rollback_before = None
                self.set_state(JobState.RUNNING, f"generation {j.generation} running")
                self.event(
                    EventKind.RUNNING,
                    f"generation {j.generation}: workers running on all {len(j.members)} nodes",
                )
                self.write_plan()

    def take_late_failures(self) -> None:
        """Take in the failures of the newest diagnosed generation's members reported after its
        diagnosis; once every member has raised the same error by itself, it is the job's last
        signature, as if all had reported in time (policy.diagnose: fail fast the next time)."""
        memory = self.decision.memory
        if memory.diagnosed is None:
            return
        generation, members, failed, before = memory.diagnosed
        late = {
            node: status
            for node in members
            if node not in failed
            and (status := self.snap.statuses.get(node)) is not None
            and status.generation == generation
            and status.state is NodeState.FAILED
        }
        if not late:
            return
        failed.update(late)
        memory.same_error = same_error(failed, before)
        if memory.same_error is not None and memory.same_error.on_every(members):
            self.job.last_signature = memory.same_error.signature
            memory.diagnosed = None

    # -- RECOVERING -----------------------------------------------------------------------------
    def recover(self) -> None:
        j, spec = self.job, self.spec
        incident = j.incident
        if incident is None:  # a restart decided on an anomaly; nothing left to diagnose
            return
        lost = self.lost()
        failed = self.reports(NodeState.FAILED)
        silent = [m for m in j.members if m not in lost and m not in failed]
        own_fault = any(r.own_fault() for r in failed.values())
        elapsed = self.now - incident.since
        # Settle: diagnose once every member has either reported or is lost. The nodes whose
        # workers only saw a peer go away report late or never (they may hang in a collective),
        # so stop waiting after settle_s once the cause is known (a worker failed by itself, a
        # node was lost or never started), and in any case once a silent node's lease would
        # have expired (a silent node is then alive but stuck).
        cause_known = bool(own_fault or lost or incident.stuck)
        ready = (
            not silent
            or (elapsed >= spec.settle_s and cause_known)
            or elapsed >= spec.node_ttl_s + 1.0
        )
        if not ready:
            wait_s = spec.settle_s if cause_known else spec.node_ttl_s + 1.0
            self.decision.due = incident.since + wait_s
            return
        memory = self.decision.memory
        before = memory.same_error
        d = diagnose(
            j.members,
            lost,
            failed,
            j.failures,
            j.last_signature,
            spec.evict_window_s,
            self.now,
            before,
        )
        for node in incident.stuck:
            d.evict.setdefault(node, f"did not start workers within {spec.warmup_timeout_s:.0f} s")
        cause = f"{d.summary}; blamed: {listing(d.blamed) or 'nobody'}"
        self.event(
            EventKind.DIAGNOSIS,
            f"generation {j.generation}: {cause}",
            blamed=d.blamed,
            cause=cause,
            lost=lost,
            detection=incident.since,
        )
        j.last_signature = d.signature
        memory.same_error = d.same_error
        memory.diagnosed = (
            None if d.signature else (j.generation, list(j.members), dict(failed), before)
        )
        if d.fail:
            self.finish(JobState.FAILED, d.fail)
            return
        self.restart(d.evict, d.summary)

    def restart(self, evict: dict[str, str], summary: str) -> None:
        """Spend a restart (once per incident), evict, take spares, decide the next generation."""
        j, spec = self.job, self.spec
        members = j.members
        # One incident, one restart: a generation that fails again before it ever ran (all
        # members started) belongs to the same incident, so it is not charged again.
        if not j.incident_open:
            j.restarts_used += 1
            if j.restarts_used > spec.max_restarts:
                self.finish(
                    JobState.FAILED,
                    f"restart budget spent: {spec.max_restarts} restarts allowed "
                    f"(--max-restarts), another incident: {summary}",
                )
                return
        for node, reason in evict.items():
            gone = {"lost": [node]} if node not in self.snap.nodes else {}
            self.evict(node, reason, f"{node} evicted: {reason}", **gone)
        survivors = [m for m in members if m not in evict]
        self.exclude_outliers(keep=survivors)
        spares = self.spares(survivors)
        while len(survivors) < spec.nnodes_max and spares:
            spare = spares.pop(0)
            survivors.append(spare)
            self.event(EventKind.SPARE, f"spare {spare} joins the job", node=spare)
        if len(survivors) < spec.nnodes_min:
            self.finish(
                JobState.FAILED,
                f"{REASON_NOT_ENOUGH_NODES}: {len(survivors)} healthy, at least "
                f"{spec.nnodes_min} needed (--nnodes) and no spare left",
            )
            return
        j.incident_open = True
        j.incident = None
        lost = [m for m in members if m not in self.snap.nodes]  # their memory tier is gone
        j.next_generation = NextGeneration(
            survivors, f"restart {j.restarts_used} of {spec.max_restarts}", lost
        )
        self.write_plan()
