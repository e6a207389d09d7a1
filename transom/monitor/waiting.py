"""Who the job waits for: straggler attribution by waiting time, and job throughput drops.

In a synchronous step every rank waits in the collective for the slowest one. Each rank reports its
step's duration, compute time and the time it spent in its communication ("sync") section; over a
window of steps the agent keeps the median duration and wait (`step_s`, `wait_s`) and a trimmed mean
(the window less its highest and lowest few, see transom.monitor.node) of the compute time and of
the *busy* time: from the end of one step to the end of the next, less the wait (`compute_s`,
`busy_s`). A trimmed mean, not a median: a slowdown from outside (a CPU quota, a rank stopped now
and then) often hits only some of the steps, which a median ignores until it is half of them, while
the machine's hiccups are left out. Every rank of a synchronous job has the same cycle, so busy time
plus wait is the same for all: the rank the others wait for is the one whose busy time stands out
(it arrives last; its own wait stays small while its peers' grows), whether it was slowed in its
compute, stopped between its steps, or both. Its *lateness* is its busy time minus the median of the
other nodes' ranks' (a median of waits would not do, as a wait is the distance to the slowest of
many noisy ranks). A slowdown inside the compute section also shows as compute above the other
nodes' (`compute excess`, all there is for a job without a sync section or without send times). A
node's delay is the larger of the two for its latest rank; it is a straggler when that delay is a
good share of the step (STRAGGLER_LATE_FRACTION of the job's median step time, or of the
generation's baseline step time when that is shorter: the ranks' step times include waiting for the
straggler, which would raise the bar by its own lateness), stands out from the other nodes' delays
and the same node is named over CONFIRM_SPAN_STEPS steps of the job, or over STRONG_SPAN_STEPS while
late by STRONG_BAR_X times the bar, and over CONFIRM_MIN_S seconds (STRONG_MIN_S for strong evidence
in two of the named rank's own windows; StragglerTracker; a loaded machine slows a rank for a moment
now and then, which on a job of short steps is many steps). Once named it need not stand out from a
second node that is late too (a second node slowed meanwhile must not hide the first), but it must
from one that is not (two nodes a little late on a loaded machine are noise, not one node to blame).
It works with 2 nodes as with many: nothing here needs a spread of peers. Its latency is bounded in
steps: the window fills in a few steps, the agents publish every SUMMARY_STEPS steps or as soon as a
rank's timings shift, and the confirmation spans CONFIRM_SPAN_STEPS, or STRONG_SPAN_STEPS for a
clear delay (tests/test_waiting_timeline.py pins a 1.5x slowdown found within 20 of the job's steps
on a simulated job, 30 healthy steps' time).

This module must never act or do I/O: it returns anomalies, the policy decides.
"""

from __future__ import annotations

import bisect
import functools
import statistics
from collections.abc import Callable, Iterable, Mapping

from transom.common import anomaly_types
from transom.common.records import Anomaly, MonitorSummary, RankSummary, Severity

STRAGGLER_MIN_NODES = 2
# A node is late when its delay is above this fraction of the job's median step time (or of the
# generation's baseline, the median over its first BASELINE_EVALUATIONS evaluations, if lower) ...
STRAGGLER_LATE_FRACTION = 0.25
# ... and at least STRAGGLER_STANDOUT times the next node's delay (one node waited for).
STRAGGLER_STANDOUT = 2.0
# Confirmation: the same node named over CONFIRM_SPAN_STEPS steps of the job, by at least
# STRAGGLER_CONFIRMATIONS evaluations, with at most STRAGGLER_MISSES evaluations in a row between
# them that named no node (one that names another node ends the streak).
CONFIRM_SPAN_STEPS = 8
STRAGGLER_CONFIRMATIONS = 3
STRAGGLER_MISSES = 1
# Strong evidence confirms sooner: a node named with a delay of at least STRONG_BAR_X times the
# bar by every evaluation over STRONG_SPAN_STEPS steps (two evaluations at least, none missed). The
# trimmed means leave out the 3 highest of 8 steps, so this takes a node late in 4 or more steps of
# two windows STRONG_SPAN_STEPS apart, by half a step on average over the 4 kept: a slowdown, not
# hiccups (3 slow steps in 8 count for nothing).
STRONG_BAR_X = 2.0
STRONG_SPAN_STEPS = 3
# And a streak lasts CONFIRM_MIN_S at least, on the controller's clock: on a job of very short
# steps (0.1 s), 8 of them are a hiccup of under a second (a checkpoint persisted, a process
# started on the node); on a job of 0.15 s steps or more it changes nothing. It keeps the 1.5x
# slowdown of tests/test_waiting_timeline.py within its bounds (median 11.5-13 steps there).
CONFIRM_MIN_S = 1.0
# Strong evidence in two of the named rank's own windows lasts STRONG_MIN_S: two summaries of
# its node, STRONG_SPAN_STEPS or more apart, each with it late by STRONG_BAR_X times the bar in
# 4 or more of a window's 8 steps, are half a second apart anyway (an agent publishes at most
# every 0.5 s: transom.monitor.node), so this takes no more than they do. At CONFIRM_MIN_S the
# DDP script's 50/50 ms duty cycle on 2 nodes (steps of 60 ms) was confirmed 0.6-1.2 s after its
# evidence was complete.
STRONG_MIN_S = 0.5
# A rank's timings shifted when its busy or compute time moved by this fraction of its step time
# (the bar itself): its agent then publishes at once (transom.monitor.node) and the controller
# takes that summary as a change, not as progress (transom.control.cluster_view), so a rank that
# begins to lag is evaluated within a step or two. A steady job's trimmed means move less: half
# the bar, as before issue 44, was crossed by a fault-free 2-node job on a loaded 2-core machine
# (steps of 50 ms) at nearly every summary, two etcd writes a node a second; with the bar, the
# simulated slowdowns are found as soon (tests/test_waiting_timeline.py).
TIMING_SHIFT_FRACTION = STRAGGLER_LATE_FRACTION
# A generation's baseline step time: the median over its first BASELINE_EVALUATIONS fresh
# evaluations.
BASELINE_EVALUATIONS = 5


def timings_shifted(
    before: RankSummary | None,
    busy_s: float | None,
    compute_s: float | None,
    stall_s: float | None = None,
    stopped_s: float | None = None,
    slower_only: bool = False,
) -> bool:
    """Whether a rank's busy, compute, stall or stopped time (now `busy_s`, `compute_s`,
    `stall_s`, `stopped_s`) moved by TIMING_SHIFT_FRACTION of its step time since `before`
    (None: nothing to compare with); with `slower_only`, grew by that much (a rank beginning to
    lag)."""
    if before is None or not before.step_s:
        return False
    bar = TIMING_SHIFT_FRACTION * before.step_s
    return any(
        now is not None
        and then is not None
        and (now - then if slower_only else abs(now - then)) >= bar
        for now, then in (
            (busy_s, before.busy_s),
            (compute_s, before.compute_s),
            (stall_s, before.stall_s),
            (stopped_s, before.stopped_s),
        )
    )


def summary_shifted(before: MonitorSummary, after: MonitorSummary) -> bool:
    """Whether some rank's timings shifted from one summary of a node to the next."""
    return ranks_shifted(before.ranks, after.ranks)


def ranks_shifted(
    before: Mapping[str, RankSummary], after: Mapping[str, RankSummary], slower_only: bool = False
) -> bool:
    """Whether some rank's timings shifted from its view in `before` to its view in `after`
    (rank -> view; with `slower_only`: grew, see timings_shifted)."""
    return any(
        timings_shifted(
            before.get(rank), r.busy_s, r.compute_s, r.stall_s, r.stopped_s, slower_only
        )
        for rank, r in after.items()
    )


def fresh_key(views: list[dict]) -> tuple:
    """The views' (node, rank, step)s, sorted: what makes an evaluation fresh."""
    return tuple(sorted((v["node"], v["rank"], v.get("step")) for v in views))


def node_delays(views: list[dict]) -> dict[str, tuple[float, int, Callable[[], dict]]]:
    """node -> (its delay in seconds, its latest rank, its evidence when asked), for nodes with
    timings.

    A rank's delay is max(lateness, compute excess, stall excess, stopped excess), each against
    the ranks of the other nodes; its lateness is its busy time (between the ends of its steps,
    less its wait) above theirs, its stall excess its recurring stalls' time a step
    (transom.monitor.rank_timing) above theirs: a duty cycle longer than a step, which the
    trimmed busy time leaves out; its stopped excess the time a step its process did not run
    (transom.monitor.stopped_time) above theirs: a stop that falls in the collective, where it
    makes every rank wait and none late.
    The medians of the other nodes' ranks come from one sorted list per measure (`_Others`), so
    a thousand nodes cost a sort, not a million comparisons; the evidence (rounded numbers and
    the others' wait) is worked out only for the node a caller names.
    """
    timed = [v for v in views if v.get("compute_s") is not None]
    nodes = {v["node"] for v in timed}
    if len(nodes) < STRAGGLER_MIN_NODES:
        return {}
    with_busy = all(v.get("busy_s") is not None for v in timed)
    compute = _Others(timed, "compute_s")
    compute_peers = {node: compute.median(node) for node in nodes}
    busy = _Others(timed, "busy_s") if with_busy else None
    busy_peers = {node: busy.median(node) for node in nodes} if busy is not None else {}
    stall = _Others(timed, "stall_s")
    stall_peers = {node: stall.median(node) for node in nodes}
    stop = _Others(timed, "stopped_s")
    stop_peers = {node: stop.median(node) for node in nodes}
    # node -> its worst rank's delay, view, lateness, compute excess, others' compute
    worst: dict[str, tuple[float, dict, float, float, float]] = {}
    for v in timed:
        node = v["node"]
        others_compute = compute_peers[node]
        assert others_compute is not None  # another node has a rank with timings
        excess = v["compute_s"] - others_compute
        late = excess
        if with_busy:
            others_busy = busy_peers[node]
            assert others_busy is not None
            late = v["busy_s"] - others_busy
        stalled = v.get("stall_s")
        others_stalled = stall_peers[node]
        if stalled is not None and others_stalled is not None:
            late = max(late, stalled - others_stalled)
        stopped, others_stopped = v.get("stopped_s"), stop_peers[node]
        if stopped is not None and others_stopped is not None:
            late = max(late, stopped - others_stopped)
        delay = max(late, excess)
        if node not in worst or delay > worst[node][0]:
            worst[node] = (delay, v, late, excess, others_compute)

    def evidence(v: dict, late: float, excess: float, others_compute: float) -> dict:
        return {
            "wait_s": _round(v.get("wait_s")),
            "peers_wait_s": _round(_Others(timed, "wait_s").median(v["node"])),
            "compute_s": round(v["compute_s"], 4),
            "peers_compute_s": round(others_compute, 4),
            "late_s": round(late, 4),
            "compute_excess_s": round(excess, 4),
            "stopped_s": _round(v.get("stopped_s")),
        }

    return {
        node: (delay, v["rank"], functools.partial(evidence, v, *rest))
        for node, (delay, v, *rest) in worst.items()
    }


class _Others:
    """The median of one measure over the ranks of every node but one, for each node."""

    def __init__(self, views: list[dict], key: str) -> None:
        present = [v for v in views if v.get(key) is not None]
        self.values = sorted(v[key] for v in present)
        self.own: dict[str, list[float]] = {}
        for v in present:
            self.own.setdefault(v["node"], []).append(v[key])

    def median(self, node: str) -> float | None:
        """statistics.median of the values of the other nodes' ranks (None when they have none)."""
        own = sorted(self.own.get(node, []))
        left = len(self.values) - len(own)
        if left <= 0:
            return None
        # The positions of the node's own values in the sorted list (one each, duplicates apart).
        removed, taken = [], 0
        for i, value in enumerate(own):
            taken = taken + 1 if i and own[i - 1] == value else 0
            removed.append(bisect.bisect_left(self.values, value) + taken)

        def kth(k: int) -> float:  # the k-th smallest value once the node's own are left out
            for index in removed:
                if index <= k:
                    k += 1
            return self.values[k]

        if left % 2:
            return kth(left // 2)
        return (kth(left // 2 - 1) + kth(left // 2)) / 2


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def median_step_s(step_times: Iterable[float | None]) -> float | None:
    """The median of the ranks' step times (None before any rank has one)."""
    values = [t for t in step_times if t]
    return statistics.median(values) if values else None


def job_step_s(views: list[dict]) -> float | None:
    """The median over rank views of their median step time (None before any has one)."""
    return median_step_s(v.get("step_s") for v in views)


class Baseline:
    """A generation's normal step time: the median of the first BASELINE_EVALUATIONS given."""

    def __init__(self) -> None:
        self.values: list[float] = []

    @property
    def full(self) -> bool:
        return len(self.values) >= BASELINE_EVALUATIONS

    def add(self, step_s: float) -> None:
        if not self.full:
            self.values.append(step_s)

    def value(self) -> float | None:
        return statistics.median(self.values) if self.values else None


def straggler_candidate(
    views: list[dict], baseline_s: float | None = None, named: str | None = None
) -> tuple[str, int, dict] | None:
    """The one node the others wait for: (node, its latest rank, evidence), or None. Its delay
    is measured against the job's step time, or `baseline_s` (the step time before anyone was
    late) when that is shorter. A node must stand out from the others to be named; `named`
    (the node a streak already names) stays named while it is late, even if another is as late
    (two slow nodes: the second must not hide the first)."""
    delays = node_delays(views)
    step_s = job_step_s(views)
    if not delays or not step_s:
        return None
    reference = min(step_s, baseline_s) if baseline_s else step_s
    bar = STRAGGLER_LATE_FRACTION * reference

    def threshold_for(node: str) -> float:
        """Late, and standing out from the latest other node unless that one is late too."""
        others = [d for n, (d, _, _) in delays.items() if n != node]
        runner_up = max(0.0, *others) if len(delays) > 2 else 0.0
        if node == named and runner_up > bar:
            return bar  # a second slow node: it must not hide the first
        return max(bar, STRAGGLER_STANDOUT * runner_up)

    worst = max(delays, key=lambda n: delays[n][0])
    if named in delays and delays[named][0] > threshold_for(named):
        worst = named
    threshold = threshold_for(worst)
    delay, rank, evidence = delays[worst]
    if delay <= threshold:
        return None
    return (
        worst,
        rank,
        {
            **evidence(),
            "delay_s": round(delay, 4),
            "step_s": round(step_s, 4),
            "reference_step_s": round(reference, 4),
            "threshold_s": round(threshold, 4),
            "bar_x": round(delay / bar, 2) if bar > 0 else None,  # its delay over the bar
            "delay_share": round(delay / step_s, 3),
            "nodes": {n: round(d, 4) for n, (d, _, _) in delays.items()},
        },
    )


def describe_wait(node: str, rank: int, evidence: dict) -> str:
    """Why `node` is the one waited for, in words."""
    share = f"{evidence['delay_share'] * 100:.0f}% of the {evidence['step_s']:.3f} s step"
    waits = (
        f"they wait {evidence['peers_wait_s']:.3f} s in the collective, it waits "
        f"{evidence['wait_s']:.3f} s"
        if evidence.get("wait_s") is not None and evidence.get("peers_wait_s") is not None
        else f"it is {evidence['delay_s']:.3f} s late"
    )
    if evidence["late_s"] > evidence["compute_excess_s"]:
        return f"{node} (rank {rank}) is the one the others wait for: {waits} ({share})"
    return (
        f"{node} (rank {rank}) is the one the others wait for: it computes "
        f"{evidence['compute_s']:.3f} s against its peers' {evidence['peers_compute_s']:.3f} s; "
        f"{waits} ({share})"
    )


def _rank_step(views: list[dict], rank: int, default: int) -> int:
    """The step of `rank`'s view (`default` when it has none)."""
    step = next((v.get("step") for v in views if v.get("rank") == rank), None)
    return default if step is None else step


class StragglerTracker:
    """Raises a straggler only once the same node was waited for over CONFIRM_SPAN_STEPS steps.

    Every fresh evaluation (the job's newest step advanced) names a node or none. A streak begins
    at the first evaluation that names a node and goes on while the evaluations name it, missing
    it at most STRAGGLER_MISSES times in a row; the straggler is raised when the streak spans
    CONFIRM_SPAN_STEPS steps with at least STRAGGLER_CONFIRMATIONS evaluations naming it, and
    CONFIRM_MIN_S seconds of `now` (when given: the controller's clock), or when it named the
    node STRONG_BAR_X times over the bar at every evaluation over STRONG_SPAN_STEPS steps and
    lasted CONFIRM_MIN_S, or STRONG_MIN_S once two of the named rank's own windows (its step
    advanced) said so. The span is counted in steps, not in evaluations, so that neither
    summaries arriving often (many near-identical windows) nor seldom (few evaluations) changes
    what confirms a straggler. Its length in seconds is not: a streak whose steps are enough but
    whose seconds are not yet is *pending*, and a later call confirms it once they are, with or
    without a fresh evaluation (the controller calls every tick; a summary may come a second
    later, and one whose rank recovered comes at once, ending the streak).
    """

    def __init__(self, span_steps: int = CONFIRM_SPAN_STEPS) -> None:
        self.span_steps = span_steps
        self.evaluated_at: int | None = None  # the newest step of the last evaluation
        self.node: str | None = None  # the node of the current streak
        self.since: int = 0  # the newest step when the streak began
        self.since_at: float | None = None  # and `now` then
        self.named = 0  # evaluations of the streak that named its node
        self.missed = 0  # evaluations in a row since that did not
        # The newest step, and the named rank's, when strong namings began.
        self.strong_since: tuple[int, int] | None = None
        # A streak whose steps confirm it and whose seconds do not yet: its straggler, and the
        # seconds the streak must last (CONFIRM_MIN_S, or STRONG_MIN_S).
        self.pending: tuple[Anomaly, float] | None = None
        self.baseline = Baseline()  # the job's step time in the first evaluations
        # What the newest evaluation saw (views, baseline, the node named), for `evaluation()`,
        # when asked to explain it: kept otherwise, a thousand ranks' views would be copied with
        # the controller's detector state at every tick (transom.control.decisions._copy).
        self._last: tuple[list[dict], float | None, str | None] | None = None

    def update(
        self, views: list[dict], now: float | None = None, explain: bool = False
    ) -> Anomaly | None:
        """The straggler once confirmed by the fresh evaluations of `views` so far; `now`, the
        controller's clock (None: the streak's length in seconds is not checked); `explain`:
        keep what a fresh evaluation saw for `evaluation()`."""
        newest = max((v["step"] for v in views if v.get("step") is not None), default=None)
        if newest is None or (self.evaluated_at is not None and newest <= self.evaluated_at):
            return self._lasted(now)  # no new step since the last evaluation
        self.evaluated_at = newest
        self.pending = None
        step_s = job_step_s(views)
        if step_s:
            self.baseline.add(step_s)
        baseline_s = self.baseline.value()
        found = straggler_candidate(views, baseline_s, named=self.node)
        self._last = (views, baseline_s, found[0] if found else None) if explain else None
        strong = found is not None and (found[2]["bar_x"] or 0.0) >= STRONG_BAR_X
        own = newest if found is None else _rank_step(views, found[1], newest)
        if found is None or found[0] != self.node:
            self.missed += 1
            self.strong_since = None
            if self.node is None or self.missed > STRAGGLER_MISSES or found is not None:
                self.node, self.since, self.named, self.missed = None, newest, 0, 0
                self.since_at = now
                if found is not None:
                    self.node, self.named = found[0], 1
                    self.strong_since = (newest, own) if strong else None
            return None
        self.named += 1
        self.missed = 0
        if not strong:
            self.strong_since = None
        elif self.strong_since is None:
            self.strong_since = (newest, own)
        spanned = newest - self.since >= self.span_steps and self.named >= STRAGGLER_CONFIRMATIONS
        strongly = (
            self.strong_since is not None and newest - self.strong_since[0] >= STRONG_SPAN_STEPS
        )
        if not (spanned or strongly):
            return None
        # STRONG_MIN_S takes two of the named rank's own windows: one evaluated again as another
        # node's summary advanced the job's newest step may be a hiccup its next summary ends.
        twice = strongly and self.strong_since is not None and own > self.strong_since[1]
        node, rank, evidence = found
        anomaly = Anomaly(
            anomaly_types.STRAGGLER,
            Severity.WARNING,
            describe_wait(node, rank, evidence),
            [node],
            [rank],
            {**evidence, "confirmed_over_steps": newest - self.since},
            step=newest,
        )
        self.pending = (anomaly, STRONG_MIN_S if twice else CONFIRM_MIN_S)
        return self._lasted(now)

    def _lasted(self, now: float | None) -> Anomaly | None:
        """The pending straggler once its streak lasted its seconds by `now` (then no longer
        pending: a later fresh evaluation confirms it again), else None."""
        if self.pending is None:
            return None
        anomaly, min_s = self.pending
        if now is not None and self.since_at is not None and now - self.since_at < min_s:
            return None
        self.pending = None
        return anomaly

    def evaluation(self) -> dict | None:
        """What the newest evaluation saw and the streak after it, in a loggable form (built
        only when asked: the controller logs it at debug level); None unless it was explained."""
        if self._last is None:
            return None
        views, baseline_s, named = self._last
        return {
            "step": self.evaluated_at,
            "delays": {n: round(d, 4) for n, (d, _, _) in node_delays(views).items()},
            "step_s": job_step_s(views),
            "baseline_s": baseline_s,
            "named": named,
            "ranks": {  # rank: busy, wait, compute, step, stall and stopped time
                v["rank"]: [_round(v.get(k)) for k in EVALUATION_MEASURES] for v in views
            },
            "streak": [self.node, self.since, self.named, self.missed],
        }


EVALUATION_MEASURES = ("busy_s", "wait_s", "compute_s", "step_s", "stall_s", "stopped_s")
