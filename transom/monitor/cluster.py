"""Cross-node detectors: the one interface the controller runs them through, and their registry.

Once per controller tick of a running generation, every registered detector sees a
`ClusterView` (each rank's flattened summary, see `detectors.rank_views`) and returns an
`Anomaly` or None; the controller hands anomalies to the policy. A detector may keep state
between ticks (confirmations, baselines): the controller makes fresh instances (`fresh()`) for
each generation and keeps them in memory only, so a new leader starts them afresh.

A new cross-node detector is a class with `update(view)` in a file of its own plus one line in
`REGISTERED`. Detectors never act and never do I/O: what to do is transom.control.policy's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from transom.common.records import Anomaly
from transom.monitor import detectors, throughput, waiting
from transom.monitor.replicas import ReplicaDetector, Split

log = logging.getLogger("transom.monitor.cluster")


@dataclass(frozen=True)
class ClusterView:
    """What every cross-node detector sees in one tick."""

    ranks: list[dict]  # one dict per rank of the generation (detectors.rank_views)
    now: float  # the controller's clock
    hang_floor_s: float  # the spec's shortest hang timeout
    finishing: bool  # some node's workers are done, so ranks stop making progress


class ClusterDetector(Protocol):
    def update(self, view: ClusterView) -> Anomaly | None: ...


class HangDetector:
    """No rank progressed for the learned timeout (see `detectors.hang`)."""

    def update(self, view: ClusterView) -> Anomaly | None:
        return None if view.finishing else detectors.hang(view.ranks, view.hang_floor_s)


class StragglerDetector:
    """The node the others wait for, in most recent fresh evaluations (`StragglerTracker`)."""

    def __init__(self) -> None:
        self.tracker = waiting.StragglerTracker()

    def update(self, view: ClusterView) -> Anomaly | None:
        if view.finishing:
            return None
        before = self.tracker.evaluated_at
        explain = log.isEnabledFor(logging.DEBUG)
        found = self.tracker.update(view.ranks, view.now, explain)
        if self.tracker.evaluated_at != before and explain:
            log.debug("straggler evaluation: %s", self.tracker.evaluation())
        return found


class ThroughputDetector:
    """The job's step time doubled: blamed on the node waited for, else job-wide."""

    def __init__(self) -> None:
        self.tracker = throughput.ThroughputTracker()

    def update(self, view: ClusterView) -> Anomaly | None:
        return None if view.finishing else self.tracker.update(view.ranks)


REGISTERED: list[Callable[[], ClusterDetector]] = [
    HangDetector,
    StragglerDetector,
    ThroughputDetector,
    ReplicaDetector,
]


def fresh(split: Split | None = None) -> list[ClusterDetector]:
    """New instances of every registered detector (one set per generation); the replica detector
    gets the previous generation's unresolved split of 2 replicas, to compare with its replay."""
    return [ReplicaDetector(split) if make is ReplicaDetector else make() for make in REGISTERED]
