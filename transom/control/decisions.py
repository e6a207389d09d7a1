"""The controller's rules: one tick of the job's state machine as a pure function.

`decide(job, snapshot, spec, now, memory)` reads the job record and a snapshot of what the
agents published (read by the controller's I/O loop) and returns the new job record, the plan
to write (if it changed), the events, and the side effects the I/O loop must perform (forget
poisoned checkpoints, count anomalies). It never touches etcd, processes or the clock, so each
rule is unit-tested on its own (tests/test_decisions.py); incidents are diagnosed by
transom.control.policy. The monitor's part (anomalies -> actions) is in `control.monitor_rules`.
What a tick reads, keeps and decides, and the steps the rules share, are in transom.control.tick,
below every rule.

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
from typing import TypeVar

from transom.common.names import listing
from transom.common.records import (
    EventKind,
    Incident,
    JobRecord,
    NextGeneration,
)
from transom.common.states import JobState, NodeState
from transom.control.grace import excused_lost, lift_evictions
from transom.control.monitor_rules import watch_monitor
from transom.control.policy import diagnose, same_error
from transom.control.set_aside import (
    SILENT_AGENT_S,
    follow_up,
    replaceable,
    resolved_by,
    take_for_dead,
)
from transom.control.tick import Decision, Memory, Snapshot, Tick
from transom.job_spec import JobSpec

T = TypeVar("T")

# How long to wait for a node's pre-flight result before starting without comparing it.
PREFLIGHT_WAIT_S = 30.0
# A running generation whose steps the monitor does not see forgets the abandoned history
# this long after it started (discard_stale).
DISCARD_AFTER_S = 60.0


def decide(
    job: JobRecord, snapshot: Snapshot, spec: JobSpec, now: float, memory: Memory | None = None
) -> Decision:
    """The job's next step; `job` and `memory` are not modified (the Decision holds new ones)."""
    tick = _Rules(_copy(job), snapshot, spec, now, _copy(memory or Memory()))
    state = tick.job.state
    if not state.terminal:
        lift_evictions(tick)
        follow_up(tick)
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
        copied: T = pickle.loads(pickle.dumps(value, pickle.HIGHEST_PROTOCOL))
        return copied
    except (pickle.PicklingError, AttributeError, TypeError):
        return copy.deepcopy(value)


class _Rules(Tick):
    """The job's state machine: one rule a state (the steps they share are Tick's)."""

    # -- helpers --------------------------------------------------------------------------------
    def lost(self) -> list[str]:
        """Members whose lease is gone, less those excused by a control-plane incident."""
        return excused_lost(self, [m for m in self.job.members if m not in self.snap.nodes])

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

    # -- a new generation -----------------------------------------------------------------------
    def start_next_generation(self) -> None:
        j, nxt = self.job, self.job.next_generation
        assert nxt is not None
        j.next_generation = None
        j.restore_step = self.snap.restore_step
        j.restore_before = j.rollback_before
        j.generation += 1
        before, j.members = j.members, nxt.members
        j.previous_members = list(before)
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
            self.decision.due = self.now  # the diagnosis: next tick, at once (recover() waits)
            return
        if len(self.reports(NodeState.SUCCEEDED)) == len(j.members):
            pending = resolved_by(self)
            if pending is not None:  # a node taken for dead is evicted (and drained) first
                self.decision.due = pending
                return
            self.finish(
                JobState.SUCCEEDED, f"all {len(j.members)} nodes finished generation {j.generation}"
            )
            return
        if j.state is JobState.WARMUP:
            started = self.reports(NodeState.RUNNING) | self.reports(NodeState.SUCCEEDED)
            if len(started) == len(j.members):
                # The incident that led here is over: the next one is charged a restart again.
                j.incident_open = False
                # Every old worker is stopped now. Shards of steps after the plan's restore
                # step, saved by an earlier generation, belong to an abandoned history (a
                # generation that went on past it, maybe with another world size, or went bad
                # before a rollback): they are forgotten on every tier once this generation has
                # trained (`discard_stale`), so they never mix with the same steps it saves
                # again: not before, as its ranks may be loading one of them (the newest step
                # they all hold: checkpoint/agreement.py). A discard an earlier generation left
                # pending (it failed before it trained) is applied now, as it stood: that
                # history is abandoned too, and a restore must never take it up again.
                if j.discard_from is not None and j.discard_generation is not None:
                    self.decision.discard_poisoned = (j.discard_from, j.discard_generation)
                j.discard_from = 0 if j.restore_step is None else j.restore_step + 1
                j.discard_generation = j.generation
                self.set_state(JobState.RUNNING, f"generation {j.generation} running")
                self.event(
                    EventKind.RUNNING,
                    f"generation {j.generation}: workers running on all {len(j.members)} nodes",
                )
                self.write_plan()
        if j.state is JobState.RUNNING:
            self.discard_stale()

    def discard_stale(self) -> None:
        """Forget the abandoned history (see watch_generation) once a rank of this generation
        has finished a step (so every rank has loaded), or DISCARD_AFTER_S after it started
        running (a script the monitor sees no steps of). Until then a restart still restores
        below the rollback bound."""
        j = self.job
        if j.discard_from is None:
            return
        trained = any(
            s.generation == j.generation and any(r.step is not None for r in s.ranks.values())
            for s in self.snap.summaries.values()
        )
        started = j.generation_started if j.generation_started is not None else self.now
        if not trained and self.now - started < DISCARD_AFTER_S:
            return
        self.decision.discard_poisoned = (j.discard_from, j.discard_generation or j.generation)
        j.discard_from = j.discard_generation = j.rollback_before = None

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
        # A worker SIGKILLed is its node's fault whatever the others report, and their reports
        # cannot change the diagnosis (policy.same_error leaves signal deaths out): no settling.
        killed = any(f.killed() for report in failed.values() for f in report.failures)
        # Every member but the silent ones lost its workers to a peer: the silent ones are
        # taken for dead before their leases expire, where spares can take their places
        # (transom.control.set_aside).
        replace = not cause_known and bool(failed) and replaceable(self, silent)
        set_aside = take_for_dead(silent, elapsed) if replace else []
        ready = (
            not silent
            or killed
            or (elapsed >= spec.settle_s and cause_known)
            or bool(set_aside)
            or elapsed >= spec.node_ttl_s + 1.0
        )
        if not ready:
            wait_s = spec.settle_s if cause_known else spec.node_ttl_s + 1.0
            if replace:
                wait_s = min(wait_s, SILENT_AGENT_S)
            self.decision.due = incident.since + wait_s
            return
        memory = self.decision.memory
        before = memory.same_error
        d = diagnose(
            j.members,
            [*lost, *set_aside],  # as if lost: the peers' errors are theirs, nobody else's
            failed,
            j.failures,
            j.last_signature,
            spec.evict_window_s,
            self.now,
            before,
        )
        for node in incident.stuck:
            d.evict.setdefault(node, f"did not start workers within {spec.warmup_timeout_s:.0f} s")
        for node in set_aside:
            d.evict.pop(node, None)  # set aside, not evicted (transom.control.set_aside)
        if set_aside:
            d.blamed = list(set_aside)
            d.summary = (
                f"{listing(set_aside)} taken for dead: no report in {elapsed:.1f} s while "
                f"the other members lost their workers to a peer"
            )
        cause = f"{d.summary}; blamed: {listing(d.blamed) or 'nobody'}"
        self.event(
            EventKind.DIAGNOSIS,
            f"generation {j.generation}: {cause}",
            blamed=d.blamed,
            cause=cause,
            lost=[*lost, *set_aside],
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
        self.restart(d.evict, d.summary, set_aside)
