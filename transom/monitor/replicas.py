"""The controller's replica check: ranks whose parameter fingerprints differ from their replicas'.

Every rank of a data-parallel job reports a fingerprint of its parameters every few steps
(transom.monitor.fingerprint, in its agent's summary). Once every rank of the generation has
reported the same step, the detector compares them:

- all equal: the replicas agree; that step is the newest known good one;
- a strict majority equal, the rest not (3 ranks or more): the others are the suspects, named
  with their nodes: a silent data corruption (`sdc`) to roll back from, and to evict the node;
- no strict majority: with 2 ranks, or ranks that never agreed in this generation (they are not
  replicas: tensor or pipeline parallel shards, FSDP), nothing is raised. A job whose ranks
  agreed once and then split without a majority (2 replicas) raises an `sdc` that names no node:
  the job rolls back, and a repeat shows whether it was transient.

The first comparison of a generation decides whether its ranks are replicas at all: equal, or
a strict majority equal. Ranks that are not replicas are never compared again in it.

Everything here crossed a process boundary (the agents' summaries): a fingerprint that is not a
short string or a step that is not a number is ignored. This module must never act or do I/O.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from transom.common import anomaly_types
from transom.common.records import Anomaly, Severity
from transom.monitor.fingerprint import MAX_DIGEST


class RankViews(Protocol):
    """What the detector reads of transom.monitor.cluster.ClusterView: one dict per rank."""

    @property
    def ranks(self) -> list[dict]: ...


class ReplicaDetector:
    """Compares the ranks' fingerprints of each step once all are in (see the module's text)."""

    def __init__(self) -> None:
        self.checked: int | None = None  # the newest step compared
        self.agreed: int | None = None  # the newest step on which every rank agreed
        self.replicas: bool | None = None  # None until the first comparison says

    def update(self, view: RankViews) -> Anomaly | None:
        if self.replicas is False or len(view.ranks) < 2:
            return None
        by_step: dict[int, dict[int, tuple[str, str]]] = {}  # step -> rank -> (digest, node)
        for v in view.ranks:
            for step, digest in _fingerprints(v.get("fingerprints")):
                by_step.setdefault(step, {})[v["rank"]] = (digest, v["node"])
        complete = [
            s
            for s, seen in by_step.items()
            if len(seen) == len(view.ranks) and (self.checked is None or s > self.checked)
        ]
        for step in sorted(complete):
            self.checked = step
            found = self._compare(step, by_step[step])
            if found is not None:
                return found
        return None

    def _compare(self, step: int, seen: dict[int, tuple[str, str]]) -> Anomaly | None:
        counts = Counter(digest for digest, _ in seen.values())
        digest, most = counts.most_common(1)[0]
        if most == len(seen):
            self.replicas, self.agreed = True, step
            return None
        majority = most * 2 > len(seen)
        if self.replicas is None and not majority:
            self.replicas = False  # never agreed: shards, not replicas
            return None
        self.replicas = True
        suspects = sorted(r for r, (d, _) in seen.items() if d != digest) if majority else []
        nodes = sorted({seen[r][1] for r in suspects})
        named = ", ".join(f"rank {r} on {seen[r][1]}" for r in suspects)
        since = (
            f"they last agreed at step {self.agreed}"
            if self.agreed is not None
            else "the generation's first comparison"
        )
        message = f"replica fingerprints differ at step {step} ({since}): " + (
            f"{named} differ from the other {most} replicas"
            if suspects
            else f"{len(counts)} different fingerprints among {len(seen)} ranks, "
            "no majority to name a node"
        )
        return Anomaly(
            anomaly_types.SDC,
            Severity.CRITICAL,
            message,
            nodes,
            suspects,
            {
                "last_agreeing_step": self.agreed,
                "fingerprints": {str(r): d for r, (d, _) in sorted(seen.items())},
            },
            step=step,
        )


def _fingerprints(value: object) -> list[tuple[int, str]]:
    """(step, digest) pairs of a rank view's `fingerprints`, each checked; others left out."""
    if not isinstance(value, dict):
        return []
    out = []
    for step, digest in list(value.items())[:8]:
        if isinstance(step, str) and step.isdigit() and isinstance(digest, str):
            if 0 < len(digest) <= MAX_DIGEST:
                out.append((int(step), digest))
    return out
