"""The controller's policy: from an incident's reports to evictions, blame and fail-fast.

Pure functions of the reports and the job's history, so each rule is tested on its own:
- a node whose lease expired is evicted (it is dead or cut off);
- a node that fails its pre-flight checks is evicted;
- the root cause of a worker failure is a node whose worker failed by itself, not one whose
  worker only saw its peer go away (`peer_error`); the same node failing again within the
  eviction window is evicted;
- the same exception twice in a row, raised by every rank, is a bug in the script: fail fast,
  after one retry. Ranks that start seconds apart reach the error at different times, and the
  first to raise ends the generation, so "every rank" is gathered over the generations of one
  incident that never trained a step (`SameError`), including a member whose failure is
  reported after the diagnosis (transom.control.decisions, `take_late_failures`). The job
  fails once every rank has raised it and it came back after a restart: the second time it is
  enough that the nodes that reported raised it, and a rank the first failure ended before it
  raised may raise it the second time (one retry however the ranks' start-up times fall). A
  node is not evicted for failing again with an exception every member raised: it follows the
  script, not the node;
- a checkpoint that no step of could be loaded by every rank (checkpoint/agreement.py) is one
  error of the job's, however each rank's copies went: a rank whose own copies were good says
  so and counts as raising it too; no node is evicted for it, and it is retried (the catalog
  lags memory by up to a second, so a plan may name a step already evicted: the next plan
  names another); the restart budget bounds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transom.checkpoint.client import LOAD_FAILED
from transom.common.records import (
    Anomaly,
    FailureKind,
    FailureReport,
    NodeStatus,
    PreflightResult,
    Severity,
)
from transom.control.links import link_outliers

# The signature of every rank's load failure, whatever each rank's copies were.
LOAD_FAILURE = f"CheckpointError: {LOAD_FAILED}"

# Why a member whose lease expired is evicted.
LEASE_EXPIRED = "node lost: its lease expired (agent dead or cut off)"


@dataclass
class Diagnosis:
    """What to do about one incident."""

    blamed: list[str] = field(default_factory=list)
    evict: dict[str, str] = field(default_factory=dict)  # node -> reason
    fail: str | None = None  # non-None: the job must FAIL, for this reason
    signature: str | None = None  # the error every rank raised, if they all raised the same
    same_error: SameError | None = None  # the evidence for it so far (see same_error)
    summary: str = ""


def _worker_failures(report: NodeStatus) -> list[FailureReport]:
    return [f for f in report.failures if f.kind is not FailureKind.PREFLIGHT]


def root_cause(failed: dict[str, NodeStatus]) -> list[str]:
    """Nodes whose workers failed by themselves; if every failure is a peer error, the earliest."""
    own = [node for node, report in failed.items() if report.own_fault()]
    if own or not failed:
        return sorted(own)
    earliest = min(failed, key=lambda n: min(f.time for f in failed[n].failures))
    return [earliest]


@dataclass(frozen=True)
class SameError:
    """Evidence that the script itself raises: the one exception that the workers of `nodes`
    raised by themselves, in one generation or in consecutive ones that never trained a step."""

    signature: str
    nodes: frozenset[str]
    trained: bool = False  # a worker of the newest generation had trained a step
    again: bool = False  # the incident before raised it too, and neither generation trained

    def on_every(self, members: list[str]) -> bool:
        return self.nodes >= set(members)


def same_error(failed: dict[str, NodeStatus], before: SameError | None) -> SameError | None:
    """The evidence after an incident's failure reports: every worker that failed by itself
    (peer errors aside) raised one exception. `before`, the evidence of the incident before,
    adds its nodes when it is the same exception and neither generation trained a step. None:
    a signal, an exception without a signature, two different ones, or no failure of its own."""
    signatures, nodes = set(), set()
    for node, report in failed.items():
        for f in _worker_failures(report):
            signature = f.signature
            if signature and LOAD_FAILED in signature:
                signature = LOAD_FAILURE  # one failure, whichever rank's copies were bad
            elif f.peer_error:
                continue
            if f.signal or not signature:
                return None
            signatures.add(signature)
            nodes.add(node)
    if len(signatures) != 1:
        return None
    signature = signatures.pop()
    trained = any(report.step is not None for report in failed.values())
    again = before is not None and before.signature == signature and not (trained or before.trained)
    if again and before is not None:
        nodes |= before.nodes
    return SameError(signature, frozenset(nodes), trained, again)


def diagnose(
    members: list[str],
    lost: list[str],
    failed: dict[str, NodeStatus],
    history: dict[str, list[float]],
    last_signature: str | None,
    evict_window_s: float,
    now: float,
    before: SameError | None = None,
) -> Diagnosis:
    """Decide an incident. `history` (node -> times of past failures) is updated in place;
    `before` is the previous incident's `same_error` evidence."""
    d = Diagnosis(same_error=same_error(failed, before))
    if d.same_error is not None and d.same_error.on_every(members):
        d.signature = d.same_error.signature
    parts = []
    for node in lost:
        d.evict[node] = LEASE_EXPIRED
        parts.append(f"{node} lost")
    for node, report in failed.items():
        preflight = [f.describe for f in report.failures if f.kind is FailureKind.PREFLIGHT]
        if preflight:
            reason = "; ".join(preflight)
            d.evict[node] = f"pre-flight check failed: {reason}"
            parts.append(f"{node} failed pre-flight")
    worker_failed = {n: r for n, r in failed.items() if _worker_failures(r)}
    d.blamed = sorted(set(lost) | set(root_cause(worker_failed) if not lost else []))
    for node in d.blamed:
        if node in d.evict:
            continue
        recent = [t for t in history.get(node, []) if now - t <= evict_window_s]
        # An error every member raised follows the script, not a node. (Some nodes raising one
        # error may be as many bad nodes, e.g. GPUs that fail to initialise: evicted as ever.)
        if recent and d.signature is None:
            d.evict[node] = (
                f"workers failed again {now - recent[-1]:.0f} s after the previous failure "
                f"(window {evict_window_s:.0f} s)"
            )
        history[node] = recent + [now]
    for node in d.blamed:
        if node in worker_failed:
            first = _worker_failures(worker_failed[node])[0]
            parts.append(f"{node}: {first.describe}")
    # The second time, the nodes that reported first are enough: the others may still be starting.
    # Gathered over two generations, every rank raising it after a restart is enough too.
    repeated = d.same_error.signature if d.same_error else None
    came_back_on_every = d.signature is not None and d.same_error is not None and d.same_error.again
    if repeated is not None and (repeated == last_signature or came_back_on_every):
        # A load failure again is no bug of the script: the catalog may have listed copies
        # that were gone (it lags memory by up to a second), and the next plan may be right.
        if repeated != LOAD_FAILURE:
            d.fail = (
                "the same error twice in a row, raised by every rank (a bug in the script?): "
                f"{repeated}"
            )
    d.summary = "; ".join(parts) or "generation stopped"
    return d


# -- anomalies from the monitor -------------------------------------------------------------------


@dataclass
class Action:
    """What to do about one anomaly: restart | evict | rollback | warn | fail | none."""

    kind: str
    reason: str
    evict: dict[str, str] = field(default_factory=dict)  # node -> reason
    rollback_before: int | None = None


def on_anomaly(
    anomaly: Anomaly,
    members: list[str],
    free_spares: int,
    nnodes_min: int,
    numerics_history: list[int],
    hang_history: list[int],
) -> Action:
    """Decide an anomaly.

    `numerics_history` and `hang_history` are the first bad steps of earlier NaN and hang
    incidents; the same failure at the same step again means retrying will not help: fail.
    """
    kind, nodes, step = anomaly.type, [n for n in anomaly.nodes if n in members], anomaly.step
    message = anomaly.message
    what = f"{kind} ({message})"
    replaceable = len(nodes) <= free_spares or len(members) - len(nodes) >= nnodes_min
    if kind in ("crash", "peer_exit"):
        return Action("none", "worker failures are decided when the incident's reports are in")
    if anomaly.severity is Severity.INFO:
        return Action("none", "for the record only")
    if kind == "nan":
        if step is not None and step in numerics_history:
            return Action(
                "fail",
                f"loss became NaN/Inf at step {step} again after rolling back before it: "
                f"the data or the model is bad there ({message})",
            )
        return Action(
            "rollback",
            f"{what}: roll back to a checkpoint before step {step}",
            rollback_before=step,
        )
    if kind == "sdc":
        return on_corruption(anomaly, nodes, replaceable, numerics_history)
    if anomaly.hardware:
        if nodes and replaceable:
            return Action(
                "evict",
                f"hardware error on {', '.join(nodes)}: {what}",
                evict={n: f"hardware error: {message or kind}" for n in nodes},
            )
        return Action("warn", f"{what}; no spare to replace {', '.join(nodes) or 'the node'}")
    if kind == "straggler":
        if nodes and len(nodes) <= free_spares:
            return Action(
                "evict",
                f"{what}: replacing it with a spare",
                evict={n: f"straggler: {message}" for n in nodes},
            )
        return Action("warn", f"{what}; no spare to replace it, training goes on at its pace")
    if kind == "hang":
        if step is not None and step in hang_history:
            return Action("fail", f"the job hung at step {step} again: {message}")
        if nodes and len(nodes) <= free_spares:
            return Action(
                "evict",
                f"{what}: evicting the blamed node(s) and restarting",
                evict={n: f"hang: {message}" for n in nodes},
            )
        return Action("restart", f"{what}: restarting every worker")
    return Action("warn", what)


def on_corruption(
    anomaly: Anomaly, nodes: list[str], replaceable: bool, numerics_history: list[int]
) -> Action:
    """Replicas' fingerprints differ (transom.monitor.replicas): roll back to a checkpoint of the
    last step on which they agreed or before, and evict the odd ones out where they can be
    replaced (a node that computes wrong numbers without an error is not trusted again; without
    a replay, a transient flip costs a spare). The same rollback point again, the node kept:
    the corruption persists where nothing can replace it, and training on would spoil it: fail."""
    agreed = anomaly.evidence.get("last_agreeing_step")
    # Fingerprints are numbered by the optimizer's count from 0 (step A: A + 1 steps taken); a
    # checkpoint's step by the script, from 0 or from 1. Restoring a step up to A is safe either
    # way: the replicas agreed after step A + 1 of a count from 1.
    before = (
        agreed + 1 if isinstance(agreed, int) and not isinstance(agreed, bool) else anomaly.step
    )
    what = f"sdc ({anomaly.message})"
    evict = {n: f"silent data corruption: {anomaly.message}" for n in nodes} if replaceable else {}
    if before is not None and before in numerics_history and not evict:
        return Action("fail", f"{what} again after rolling back, and no node to evict")
    return Action(
        "rollback",
        f"{what}: roll back to a checkpoint before step {before}"
        + (f" and evict {', '.join(nodes)}" if evict else ""),
        evict=evict,
        rollback_before=before,
    )


# -- warm-up --------------------------------------------------------------------------------------

# A node whose pre-flight compute score is below this fraction of the nodes' median is excluded.
PREFLIGHT_SLOW_RATIO = 0.5
PREFLIGHT_MIN_NODES = 3


def slow_outliers(results: dict[str, PreflightResult]) -> dict[str, str]:
    """Nodes far below their peers in the pre-flight compute benchmark or link test (links.py)
    -> why to exclude them."""
    slow_links = link_outliers(results)
    scores = {n: r.compute_gflops for n, r in results.items() if r.compute_gflops}
    if len(scores) < PREFLIGHT_MIN_NODES:
        return slow_links
    ordered = sorted(scores.values())
    median = (
        ordered[len(ordered) // 2]
        if len(ordered) % 2
        else sum(ordered[len(ordered) // 2 - 1 :][:2]) / 2
    )
    return slow_links | {
        n: (
            f"pre-flight compute benchmark {s:.1f} GFLOP/s is {s / median:.2f}x its peers' median "
            f"{median:.1f} GFLOP/s (below {PREFLIGHT_SLOW_RATIO}x)"
        )
        for n, s in scores.items()
        if s < PREFLIGHT_SLOW_RATIO * median
    }
