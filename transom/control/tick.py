"""The working state of one controller tick, below every rule that uses it.

What the I/O loop read for the tick (`Snapshot`), what the controller keeps in memory from tick
to tick (`Memory`), what the tick decided (`Decision`), and `Tick`: the state of one
`decisions.decide` call with the outputs and steps its rules share (events, the plan,
evictions, a restart). The rules are in transom.control.decisions (the job's states),
transom.control.grace (control-plane incidents) and transom.control.monitor_rules; each takes a
`Tick`. Pure like them: it must never touch etcd, processes or the clock, and never import a
rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transom.common.names import natural_key
from transom.common.records import (
    Anomaly,
    Event,
    EventKind,
    Eviction,
    JobRecord,
    MonitorSummary,
    NextGeneration,
    NodeRegistration,
    NodeStatus,
    Plan,
    PreflightResult,
    SummaryRequest,
)
from transom.common.states import JobState, NodeState
from transom.control.policy import SameError, slow_outliers
from transom.job_spec import JobSpec
from transom.monitor import cluster
from transom.monitor.replicas import Split

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
    # Set while the members' checkpoint servers have yet to send what they hold (the I/O loop
    # waits, up to controller.FLUSH_WAIT_S, before it reads `restore_step`): no tick then.
    holdings_pending: bool = False
    # Measured by the controller on its own clock (transom.control.observed): seconds since it
    # saw each member's summary change; its newest gap in reaching etcd and how long ago it
    # ended (None: no gap seen).
    summary_ages: dict[str, float] = field(default_factory=dict)
    store_gap_s: float = 0.0
    since_store_gap_s: float | None = None
    # Seconds since this controller took the lead of a job another had led, in its first
    # snapshot as leader, else None: leases missing
    # then may have vanished in the etcd stall that cost the previous leader its own lease
    # (transom.control.grace).
    since_takeover_s: float | None = None


@dataclass
class Memory:
    """Detector state the controller keeps in memory only (a new leader starts it afresh)."""

    generation: int = 0
    detectors: list[cluster.ClusterDetector] = field(default_factory=cluster.fresh)
    # (anomaly type, nodes) warned about
    warned: set[tuple[str, tuple[str, ...]]] = field(default_factory=set)
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
    # 2 replicas split without a majority and the job rolled back: the next generation's replica
    # detector compares the replay of that step with it (transom.monitor.replicas).
    sdc_split: Split | None = None
    asked: str = ""  # the id of the newest SummaryRequest written


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
    # Ask every member for a fresh monitor summary (`plan/summaries`; None: no need).
    ask: SummaryRequest | None = None

    changed: bool = False  # something to commit (the record, the plan or events)


class Tick:
    """The working state of one `decisions.decide` call, and the steps its rules share."""

    def __init__(
        self, job: JobRecord, snap: Snapshot, spec: JobSpec, now: float, memory: Memory
    ) -> None:
        self.job, self.snap, self.spec, self.now = job, snap, spec, now
        self.decision = Decision(job, memory=memory)

    # -- outputs --------------------------------------------------------------------------------
    def event(self, kind: EventKind, message: str, **fields: Any) -> None:
        # Distinct times keep the events' keys distinct and in order within one commit.
        at = self.now + len(self.decision.events) * 1e-6
        fields.setdefault("generation", self.job.generation)
        self.decision.events.append(Event(at, kind, message, **fields))

    def write_plan(self) -> None:
        j = self.job
        self.decision.plan = Plan(
            j.generation,
            list(j.members),
            j.state,
            dict(j.evicted),
            j.restarts_used,
            j.restore_step,
            j.restore_before,
            list(j.previous_members),
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
        """The healthy nodes outside `members` (a set: a thousand nodes are looked up), less
        those set aside (their lease may be a dead node's: transom.control.set_aside)."""
        taken = set(members) | set(self.job.set_aside)
        return [n for n in self.healthy_nodes() if n not in taken]

    def reports(self, state: NodeState) -> dict[str, NodeStatus]:
        """The members' statuses of the current generation in `state`."""
        s, g = self.snap.statuses, self.job.generation
        return {
            m: s[m]
            for m in self.job.members
            if m in s and s[m].generation == g and s[m].state is state
        }

    def evict(self, node: str, reason: str, message: str, **fields: Any) -> None:
        known = self.snap.nodes.get(node) or self.snap.statuses.get(node)
        incarnation = known.incarnation if known is not None else ""
        self.job.evicted[node] = Eviction(reason, self.now, self.job.generation, incarnation)
        self.event(EventKind.EVICT, message, node=node, **fields)

    # -- steps the rules share ------------------------------------------------------------------
    def exclude_outliers(self, keep: list[str] | tuple[str, ...] = ()) -> None:
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
                    preflight=results[node],
                )

    def restart(
        self, evict: dict[str, str], summary: str, set_aside: list[str] | None = None
    ) -> None:
        """Spend a restart (once per incident), evict, take spares, decide the next generation.
        `set_aside`: members left out of it, not evicted, as if lost (their memory tier too);
        spares take their places, and one whose agent lives on is a spare from then on."""
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
        aside = list(set_aside or [])
        survivors = [m for m in members if m not in evict and m not in aside]
        self.exclude_outliers(keep=survivors)
        spares = [n for n in self.spares(survivors) if n not in aside]
        if aside and len(survivors) + len(spares) < spec.nnodes_min:
            # Taking them for dead must never end the job: members still, their leases decide.
            survivors, aside = [m for m in members if m not in evict], []
        for node in aside:
            j.set_aside[node] = self.now
            self.event(
                EventKind.WARNING,
                f"{node} set aside: its agent did not report while its peers lost their "
                f"workers to it; a spare takes its place (a spare again if its lease holds)",
                node=node,
            )
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
        # their memory tier is gone (or, set aside, not to be relied on)
        lost = [m for m in members if m not in self.snap.nodes or m in aside]
        j.next_generation = NextGeneration(
            survivors, f"restart {j.restarts_used} of {spec.max_restarts}", lost
        )
        self.write_plan()
