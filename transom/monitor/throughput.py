"""The job's throughput drop: the median step time of the generation's ranks against its
baseline, judged across nodes.

Its cause is named when one node is waited for (transom.monitor.waiting's straggler
candidate); when every node slowed at once and none is waited for, the drop is job-wide (the
machine is loaded, the storage or network is slow for everyone) and no node is blamed.

This module must never act or do I/O: it returns anomalies, the policy decides.
"""

from __future__ import annotations

from transom.common.records import Anomaly, Severity
from transom.monitor.waiting import (
    Baseline,
    describe_wait,
    fresh_key,
    job_step_s,
    straggler_candidate,
)

# A drop: the job's median step time above THROUGHPUT_DROP_RATIO x the generation's baseline.
THROUGHPUT_DROP_RATIO = 2.0
THROUGHPUT_DROP = "throughput_drop"


class ThroughputTracker:
    """The job's median step time against this generation's baseline; raised once a drop."""

    def __init__(self) -> None:
        self.baseline = Baseline()
        self.raised = False
        # The hash of the newest views' (node, rank, step)s: not the thousand tuples themselves,
        # which the controller would copy with its detector state at every tick.
        self.last_key: int | None = None

    def update(self, views: list[dict]) -> Anomaly | None:
        key = hash(fresh_key(views))
        if key == self.last_key:
            return None
        self.last_key = key
        timed = [v for v in views if v.get("step_s")]
        if not timed or len(timed) < len(views):
            return None  # some rank has no comparable steps yet
        now = job_step_s(timed)
        if now is None:
            return None
        if not self.baseline.full:
            self.baseline.add(now)
            return None
        base = self.baseline.value() or 0.0
        dropped = base > 0 and now > THROUGHPUT_DROP_RATIO * base
        was_raised, self.raised = self.raised, dropped
        if not dropped or was_raised:
            return None
        return throughput_drop(views, base, now)


def throughput_drop(views: list[dict], base: float, now: float) -> Anomaly:
    """A drop from `base` to `now` seconds a step, blamed on the node waited for if there is one."""
    what = f"median step time {now:.3f} s, {now / base:.1f}x the generation's baseline {base:.3f} s"
    evidence: dict = {"baseline_step_s": round(base, 4), "recent_step_s": round(now, 4)}
    found = straggler_candidate(views, base)
    if found is not None:
        node, rank, wait = found
        return Anomaly(
            THROUGHPUT_DROP,
            Severity.WARNING,
            f"{what}: {describe_wait(node, rank, wait)}",
            [node],
            [rank],
            {**evidence, "cause": "waited_for", "waiting": wait},
        )
    nodes = sorted({v["node"] for v in views})
    cause = "job-wide" if len(nodes) > 1 else "unknown"
    why = (
        "every node slowed at once and none is waited for: a job-wide slowdown "
        "(the machine loaded, a shared resource slow), no node to blame"
        if len(nodes) > 1
        else "one node: whether the node or its surroundings slowed is not known"
    )
    return Anomaly(
        THROUGHPUT_DROP,
        Severity.WARNING,
        f"{what}; {why}",
        [],
        [],
        {**evidence, "cause": cause, "nodes": nodes},
    )
