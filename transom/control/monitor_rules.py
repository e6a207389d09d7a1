"""The controller's monitor rules: cross-node detectors, then the policy's action per anomaly.

Part of one `decisions.decide` tick while the job is RUNNING: collects the agents' new
anomalies, runs the registered cross-node detectors (transom.monitor.cluster) and the telemetry
gap check on their summaries, then applies `policy.on_anomaly` to each. Pure like `decisions`:
no etcd, no clock. Ages are the controller's own observations (`Snapshot.summary_ages`, see
transom.control.observed), never an agent's timestamp subtracted from the controller's clock.
"""

from __future__ import annotations

from transom.common.records import Anomaly, Event, EventKind, Severity, SummaryRequest
from transom.common.states import JobState, NodeState
from transom.control.policy import on_anomaly
from transom.control.tick import Tick
from transom.monitor import cluster, detectors
from transom.monitor.replicas import Split

# A member whose monitor summary has not changed for this long (as the controller saw it, while
# its agent lives) has a telemetry gap: the agents' keep-alive and 3 s for a late one.
SUMMARY_GAP_S = detectors.SUMMARY_KEEPALIVE_S + 3.0
# After the first NaN report, wait this long for the other nodes' (the first bad step may be
# elsewhere).
NUMERICS_SETTLE_S = 0.5


def watch_monitor(tick: Tick) -> None:
    """Cross-node detectors on the agents' summaries; every anomaly goes through the policy."""
    j, memory, now = tick.job, tick.decision.memory, tick.now
    if memory.generation != j.generation:
        memory.generation = j.generation
        memory.detectors = cluster.fresh(memory.sdc_split)
        memory.sdc_split = None  # the new detectors have it
        memory.warned.clear()
    summaries = tick.snap.summaries
    handled = set(j.handled_anomalies)
    found = [
        a
        for s in summaries.values()
        if s.generation == j.generation
        for a in s.anomalies
        if a.id not in handled
    ]
    found = earliest_numerics(tick, found)
    view = cluster.ClusterView(
        detectors.rank_views(summaries, j.generation, now, tick.snap.summary_ages),
        now,
        tick.spec.hang_floor_s,
        finishing=bool(tick.reports(NodeState.SUCCEEDED)),  # ranks that are done make no progress
    )
    for detector in memory.detectors:
        anomaly = detector.update(view)
        if anomaly is not None:
            found.append(anomaly)
            controller_anomaly(tick, anomaly)
    for node in j.members:
        s = summaries.get(node)
        if node in tick.snap.nodes and s is not None and s.generation == j.generation:
            age = tick.snap.summary_ages.get(node, 0.0)
            if age > SUMMARY_GAP_S:
                gap = Anomaly(
                    "telemetry_gap",
                    Severity.WARNING,
                    f"{node}: no monitor summary for {age:.1f} s while its agent is alive",
                    [node],
                    time=now,
                )
                found.append(gap)
                controller_anomaly(tick, gap)
    for anomaly in found:
        if not anomaly.id:
            continue  # a repeated warning of the controller's own
        j.handled_anomalies.append(anomaly.id)
        tick.decision.anomalies.append(anomaly)
        if act(tick, anomaly):
            return


def earliest_numerics(tick: Tick, found: list[Anomaly]) -> list[Anomaly]:
    """Hold NaN reports for NUMERICS_SETTLE_S after the first, then keep the earliest step's;
    no longer than until every rank of the generation has either reported one (each reports its
    first bad step) or been seen past the step before the earliest reported without one (its
    node's summary says it finished that step, and lists its NaN report if it had one): the
    earliest is known then.

    A NaN poisons every rank's weights within a step, so several nodes report one; the rollback
    must go before the first bad step, which the slowest reporter may hold. The demo's NaN rank
    holds its peers in the all-reduce: none of them ever reports one, but each has finished the
    step before. Their summaries said so only at their next keep-alive (the hold ran out first):
    the hold asks every member for a fresh one (`Decision.ask`), answered within a tick.
    """
    nans = [a for a in found if a.type == "nan"]
    if not nans:
        return found
    # When the controller first saw each report (an agent's `time` is on the agent's clock).
    seen = tick.decision.memory.first_seen
    for a in nans:
        seen.setdefault(a.id, tick.now)
    settled_at = min(seen[a.id] for a in nans) + NUMERICS_SETTLE_S
    world = range(len(tick.job.members) * tick.spec.nproc_per_node)
    said = {rank for a in nans for rank in a.ranks} | _clean_before(tick, nans)
    every_rank = set(world) <= said
    first = min(nans, key=lambda a: (a.step is None, a.step or 0, a.time))
    if tick.now < settled_at and not every_rank:
        due = tick.decision.due
        tick.decision.due = settled_at if due is None else min(due, settled_at)  # not a tick late
        if first.id != tick.decision.memory.asked:
            tick.decision.memory.asked = first.id
            tick.decision.ask = SummaryRequest(tick.job.generation, first.id)
        return [a for a in found if a.type != "nan"]
    tick.job.handled_anomalies.extend(a.id for a in nans if a is not first)
    return [a for a in found if a.type != "nan" or a is first]


def _clean_before(tick: Tick, nans: list[Anomaly]) -> set[int]:
    """The ranks whose node's summary (this generation's) shows them finished with the step
    before the earliest NaN reported, and lists no NaN of theirs: none of theirs comes earlier.
    A node speaks for its own ranks only (the plan's: its place among the members)."""
    steps = [a.step for a in nans if a.step is not None]
    if not steps:
        return set()
    before, per_node = min(steps) - 1, tick.spec.nproc_per_node
    clean: set[int] = set()
    for place, node in enumerate(tick.job.members):
        s = tick.snap.summaries.get(node)
        if s is None or s.generation != tick.job.generation:
            continue
        bad = {rank for a in s.anomalies if a.type == "nan" for rank in a.ranks}
        own = range(place * per_node, (place + 1) * per_node)
        clean.update(
            rank
            for rank in own
            if rank not in bad
            and (view := s.ranks.get(str(rank))) is not None
            and view.step is not None
            and view.step >= before
        )
    return clean


def controller_anomaly(tick: Tick, anomaly: Anomaly) -> None:
    """An anomaly the controller found itself: give it an id and write its event.

    A warning already given for the same nodes this generation stays without id (not acted on).
    """
    anomaly.generation = tick.job.generation
    anomaly.time = tick.now  # observed now, on the controller's clock (events are timed by it too)
    if anomaly.severity is not Severity.CRITICAL and (
        (anomaly.type, tuple(anomaly.nodes)) in tick.decision.memory.warned
    ):
        return
    anomaly.id = f"controller-{tick.job.generation}-{anomaly.type}-{tick.now:.3f}"
    tick.decision.events.append(
        Event.of_anomaly(anomaly, tick.now + len(tick.decision.events) * 1e-6)
    )


def act(tick: Tick, anomaly: Anomaly) -> bool:
    """Apply the policy's action for one anomaly; True when it ended the generation."""
    j, spec = tick.job, tick.spec
    free = len(tick.spares(j.members))
    action = on_anomaly(anomaly, j.members, free, spec.nnodes_min, j.numerics_steps, j.hang_steps)
    if action.kind == "none":
        return False
    key = (anomaly.type, tuple(anomaly.nodes))
    if action.kind == "warn":
        if key not in tick.decision.memory.warned:
            tick.decision.memory.warned.add(key)
            tick.event(
                EventKind.WARNING,
                action.reason,
                anomaly=anomaly.id,
                anomaly_type=anomaly.type,
                nodes=anomaly.nodes,
            )
        return False
    tick.event(
        EventKind.DECISION,
        f"{action.kind}: {action.reason}",
        action=action.kind,
        anomaly=anomaly.id,
        anomaly_type=anomaly.type,
        nodes=anomaly.nodes,
        detection=anomaly.time,
    )
    if action.kind == "fail":
        tick.finish(JobState.FAILED, action.reason)
        return True
    if anomaly.type == "hang" and anomaly.step is not None:
        j.hang_steps.append(anomaly.step)
    if action.kind == "rollback":
        tick.decision.memory.sdc_split = Split.of(anomaly)  # None unless 2 replicas split
    if action.rollback_before is not None:
        j.numerics_steps.append(action.rollback_before)
        previous = j.rollback_before
        j.rollback_before = (
            min(previous, action.rollback_before) if previous else action.rollback_before
        )
        tick.event(
            EventKind.ROLLBACK,
            f"next generation restores a checkpoint from before step {j.rollback_before}",
            rollback_before=j.rollback_before,
        )
    tick.set_state(JobState.RECOVERING, action.reason)
    tick.event(EventKind.INCIDENT, action.reason, detection=anomaly.time, anomaly=anomaly.id)
    tick.restart(action.evict, action.reason)
    return True
