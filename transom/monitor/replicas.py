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
  the job rolls back, and the next generation replays that step.

The replay classifies the split (`Split`: the controller hands it to the next generation's
detector). Training is deterministic, so the replay of the step from the agreeing snapshot is
the step as it should have been. A generation whose first fingerprinted step is past the last
agreeing one did not replay from it (a script that resumes from its own newest checkpoint,
saved after the split, may skip the rollback): its step is compared as any other, never as a
replay. A replay's verdict:
- every node agrees in the replay: the split was transient, an `sdc` of severity INFO says so
  (for the record, nothing to act on), naming the nodes whose digest differed from the replay's
  when another node's equalled it. Usually none did: in data-parallel training the gradients'
  all-reduce carries one replica's corruption into the others' next updates, so a fingerprint
  taken a step or more after the flip finds every replica off the replay. Then the values
  decide: each node's replay compared its parameters with those it had at that step
  (transom.monitor.evidence), and the node whose list of deviations shows elements no other
  node's does is named (`odd_ones_out`): the replicas still differ exactly where one was
  corrupted, and there the others hold the replay's values within rounding;
- the replay splits again, some nodes reproducing their digests and the others not: those
  others computed something else twice, a persistent corruption, a critical `sdc` naming them
  (evicted where they can be replaced). The same spread makes this rare past the flip's own
  step; a split the replay cannot tell apart (every node, or none, reproduced its digest) is
  raised as before, without a node.

The first comparison of a generation decides whether its ranks are replicas at all: equal, or
a strict majority equal. Ranks that are not replicas are never compared again in it.

Everything here crossed a process boundary (the agents' summaries): a fingerprint that is not a
short string or a step that is not a number is ignored. This module must never act or do I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from transom.common import anomaly_types
from transom.common.records import Anomaly, Severity
from transom.monitor import evidence
from transom.monitor.evidence import Deviations
from transom.monitor.fingerprint import MAX_DIGEST

# Units within this share of each other are the same element's deviation seen by two replicas
# (lists cross a process boundary as JSON, rounded to 6 digits: transom.monitor.evidence).
SAME_UNITS = 1e-4


class RankViews(Protocol):
    """What the detector reads of transom.monitor.cluster.ClusterView: one dict per rank."""

    @property
    def ranks(self) -> list[dict]: ...


@dataclass(frozen=True)
class Split:
    """Replicas that split with no majority: the step and each node's digest of it, for the
    next generation's replay of that step."""

    step: int
    digests: dict[str, str]  # node -> digest
    agreed: int | None = None  # the last step the replicas agreed on before it

    @classmethod
    def of(cls, anomaly: Anomaly) -> Split | None:
        """The split an `sdc` naming no node saw (None for any other anomaly)."""
        fingerprints = anomaly.evidence.get("fingerprints")
        nodes = anomaly.evidence.get("nodes")
        agreed = anomaly.evidence.get("last_agreeing_step")
        if anomaly.type != anomaly_types.SDC or anomaly.nodes or anomaly.step is None:
            return None
        if not isinstance(fingerprints, dict) or not isinstance(nodes, dict):
            return None
        digests = {nodes[r]: d for r, d in fingerprints.items() if r in nodes}
        if len(set(digests.values())) < 2:
            return None
        return cls(anomaly.step, digests, agreed if isinstance(agreed, int) else None)

    def replayed_by(self, first_step: int | None) -> bool:
        """Whether a generation whose first fingerprinted step is `first_step` replays the split
        step from the last agreeing one (restored at it or before). A script that resumes from
        its own newest checkpoint may have skipped the rollback: its step is no replay."""
        return first_step is not None and self.agreed is not None and first_step <= self.agreed + 1


class ReplicaDetector:
    """Compares the ranks' fingerprints of each step once all are in (see the module's text)."""

    def __init__(self, split: Split | None = None) -> None:
        self.checked: int | None = None  # the newest step compared
        self.first: int | None = None  # the first step compared (the generation's first)
        self.agreed: int | None = None  # the newest step on which every rank agreed
        self.replicas: bool | None = None  # None until the first comparison says
        self.split = split  # the previous generation's split, to compare with its replay

    def update(self, view: RankViews) -> Anomaly | None:
        if self.replicas is False or len(view.ranks) < 2:
            return None
        by_step: dict[int, dict[int, tuple[str, str]]] = {}  # step -> rank -> (digest, node)
        # step -> node -> its replay's deviations from its earlier parameters (evidence)
        deviations: dict[int, dict[str, Deviations]] = {}
        for v in view.ranks:
            for step, digest in _fingerprints(v.get("fingerprints")):
                by_step.setdefault(step, {})[v["rank"]] = (digest, v["node"])
            for step, pairs in _deviations(v.get("deviations")):
                deviations.setdefault(step, {})[v["node"]] = pairs
        complete = [
            s
            for s, seen in by_step.items()
            if len(seen) == len(view.ranks) and (self.checked is None or s > self.checked)
        ]
        for step in sorted(complete):
            self.checked = step
            found = self._compare(step, by_step[step], deviations.get(step, {}))
            if found is not None:
                return found
        return None

    def _compare(
        self, step: int, seen: dict[int, tuple[str, str]], deviations: dict[str, Deviations]
    ) -> Anomaly | None:
        if self.first is None:
            self.first = step
        if self.split is not None and step >= self.split.step:
            split, self.split = self.split, None
            if step == split.step and split.replayed_by(self.first):
                replayed = self._replayed(split, step, seen, deviations)
                if replayed is not None:
                    return replayed
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
                "nodes": {str(r): n for r, (_, n) in sorted(seen.items())},
            },
            step=step,
        )

    def _replayed(
        self,
        split: Split,
        step: int,
        seen: dict[int, tuple[str, str]],
        deviations: dict[str, Deviations],
    ) -> Anomaly | None:
        """The replay of the split step: transient (INFO, naming who was wrong), persistent
        (CRITICAL, naming who is wrong again), or None when it cannot tell."""
        now = {node: digest for digest, node in seen.values()}
        ranks = {node: r for r, (_, node) in seen.items()}
        evidence: dict = {"split": split.digests, "replay": now, "last_agreeing_step": self.agreed}
        if len(set(now.values())) == 1:
            self.replicas, self.agreed = True, step
            good = next(iter(now.values()))
            right = [n for n, d in split.digests.items() if d == good]
            wrong = sorted(n for n, d in split.digests.items() if d != good) if right else []
            how = f"{', '.join(wrong)} had computed other numbers"
            if not wrong:
                known = deviations.keys() >= split.digests.keys()
                wrong = odd_ones_out(deviations) if known else []
                evidence["deviations"] = {n: deviations[n][:4] for n in sorted(deviations)}
                how = (
                    f"{', '.join(wrong)} had other numbers where the replicas differ, the others "
                    "those of the replay within rounding"
                    if wrong
                    else "no replica's digest of it was the replay's (the gradients' all-reduce "
                    "carries one replica's corruption to the others), nor its values where "
                    "they differ: no node to name"
                )
            return Anomaly(
                anomaly_types.SDC,
                Severity.INFO,
                f"the replay of step {step} agrees on every replica: the split was transient; "
                + how,
                wrong,
                sorted(ranks[n] for n in wrong if n in ranks),
                evidence,
                step=step,
            )
        changed = sorted(n for n, d in now.items() if n in split.digests and split.digests[n] != d)
        same = [n for n, d in now.items() if split.digests.get(n) == d]
        if not changed or not same:
            return None  # every node, or none, reproduced its digest: no way to tell
        self.replicas = True
        return Anomaly(
            anomaly_types.SDC,
            Severity.CRITICAL,
            f"replica fingerprints differ at step {step} again after the rollback: "
            f"{', '.join(changed)} computed other numbers than before, "
            f"{', '.join(sorted(same))} the same: a persistent corruption on "
            f"{', '.join(changed)}",
            changed,
            sorted(ranks[n] for n in changed),
            evidence,
            step=step,
        )


def odd_ones_out(found: dict[str, Deviations]) -> list[str]:
    """The nodes whose replay found an element off that no other node's found (see the module's
    text), when some nodes, not all, have one; else none.

    Every replica's deviations list the same elements with the same units (they differ from
    the common replay alike) except where a replica was corrupted. An element of one node's
    list is that node's own when every other list lacks it (or has it with other units) and
    that list, holding the TOP largest of its node, ends below it: had the other node been as
    far off there, its list would have shown it."""
    named = []
    for node, mine in sorted(found.items()):
        others = [dict(theirs) for other, theirs in found.items() if other != node]
        if any(_own(index, units, others) for index, units in mine):
            named.append(node)
    return named if len(named) < len(found) else []


def _own(index: int, units: float, others: list[dict[int, float]]) -> bool:
    """Whether no other list shows element `index` `units` off, nor would have (odd_ones_out)."""
    for theirs in others:
        if index in theirs and abs(theirs[index] - units) <= SAME_UNITS * units:
            return False
        if len(theirs) >= evidence.TOP and units <= min(theirs.values()):
            return False
    return True


def _deviations(value: object) -> list[tuple[int, Deviations]]:
    """(step, deviations) pairs of a rank view's `deviations`, each checked; others left out."""
    if not isinstance(value, dict):
        return []
    out = []
    for step, pairs in list(value.items())[:8]:
        if not (isinstance(step, str) and step.isdigit() and isinstance(pairs, list)):
            continue
        if len(pairs) <= evidence.TOP and all(evidence.is_deviation(p) for p in pairs):
            out.append((int(step), [(i, float(u)) for i, u in pairs]))
    return out


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
