"""Detectors: pure functions (and two small stateful trackers) that turn signals into anomalies.

Per-rank detectors (numerics, throughput, log lines, telemetry gaps) run in the node agent next
to the raw samples; cross-node detectors (hang, straggler) run in the controller on the compact
per-node summaries the agents publish (see transom.monitor.node). Every detector returns an
`Anomaly` naming the node(s) and rank(s) to suspect and the evidence. Detectors never act:
what to do about an anomaly is transom.control.policy's decision.
"""

from __future__ import annotations

import math
import statistics
import time

from transom.common.records import Anomaly, MonitorSummary, Severity

__all__ = ["Anomaly"]  # defined in transom.common.records; re-exported for the detectors' users

# Hang: no rank made progress for max(spec.hang_floor_s, HANG_STEP_FACTOR x median step time).
HANG_STEP_FACTOR = 4.0
# While a rank is in a phase (checkpoint save, evaluation) a hang takes this long.
PHASE_HANG_S = 300.0
# A rank whose heartbeat is older than this is stopped or dead (the heartbeat beats every 0.5 s).
HEARTBEAT_GAP_S = 3.0
# A live, not stopped, rank without heartbeat for this long is a telemetry gap (a process can hold
# Python's lock for seconds, e.g. while tearing down its process group at exit).
TELEMETRY_GAP_S = 10.0
# Loss spike: above median + LOSS_SPIKE_MADS x MAD of the window and LOSS_SPIKE_RATIO x median.
LOSS_WINDOW = 50
LOSS_MIN_SAMPLES = 20
LOSS_SPIKE_MADS = 10.0
LOSS_SPIKE_RATIO = 2.0
# Throughput drop: recent median step time above THROUGHPUT_DROP_RATIO x the baseline median.
THROUGHPUT_DROP_RATIO = 2.0
# Straggler: a node's compute time above the nodes' median by STRAGGLER_MADS robust deviations
# and by at least STRAGGLER_MIN_EXCESS (relative), in STRAGGLER_CONFIRMATIONS evaluations in a row.
STRAGGLER_MIN_NODES = 3
STRAGGLER_MADS = 5.0
STRAGGLER_MIN_EXCESS = 0.4
STRAGGLER_CONFIRMATIONS = 2
MAD_TO_SIGMA = 1.4826


def median_mad(values: list[float]) -> tuple[float, float]:
    m = statistics.median(values)
    return m, statistics.median(abs(v - m) for v in values)


# -- per rank (agent) ---------------------------------------------------------------------------


def crash(node: str, failures: list[dict]) -> Anomaly:
    """Workers exited non-zero or by a signal (failures as transom.control.failures reports them).

    Workers that only saw a peer go away (`peer_error`) are a consequence, not a cause: that is a
    `peer_exit` of severity info, so only the node whose worker failed by itself is suspected.
    """
    own = [f for f in failures if not f.get("peer_error")]
    type_, severity, shown = (
        ("crash", Severity.CRITICAL, own) if own else ("peer_exit", Severity.INFO, failures)
    )
    return Anomaly(
        type_,
        severity,
        "; ".join(f.get("describe", "worker failed") for f in shown),
        nodes=[node],
        ranks=[f["rank"] for f in shown],
        evidence={
            "failures": [
                {k: f.get(k) for k in ("rank", "exitcode", "signal", "signature", "peer_error")}
                for f in failures
            ]
        },
        time=min(f.get("time", time.time()) for f in failures),
    )


def numerics(
    node: str, rank: int, step: int, loss: float | None, window: list[float]
) -> Anomaly | None:
    """NaN/Inf loss, or a loss spike against the recent window of finite losses."""
    if loss is None:
        return None
    if not math.isfinite(loss):
        return Anomaly(
            "nan",
            Severity.CRITICAL,
            f"rank {rank} loss is {loss} at step {step}",
            [node],
            [rank],
            {"loss": str(loss)},
            step=step,
        )
    if len(window) >= LOSS_MIN_SAMPLES:
        m, mad = median_mad(window)
        if loss > m + LOSS_SPIKE_MADS * MAD_TO_SIGMA * mad and loss > LOSS_SPIKE_RATIO * m:
            return Anomaly(
                "loss_spike",
                Severity.WARNING,
                f"rank {rank} loss {loss:.4g} at step {step} is "
                f"{loss / m:.1f}x the recent median {m:.4g}",
                [node],
                [rank],
                {"loss": loss, "median": m, "mad": mad},
                step=step,
            )
    return None


def throughput_drop(node: str, baseline_s: list[float], recent_s: list[float]) -> Anomaly | None:
    """Recent step times well above this generation's baseline."""
    if len(baseline_s) < 5 or len(recent_s) < 5:
        return None
    base, now = statistics.median(baseline_s), statistics.median(recent_s)
    if base > 0 and now > THROUGHPUT_DROP_RATIO * base:
        return Anomaly(
            "throughput_drop",
            Severity.WARNING,
            f"{node}: median step time {now:.3f} s, "
            f"{now / base:.1f}x the generation's baseline {base:.3f} s",
            [node],
            [],
            {"baseline_step_s": base, "recent_step_s": now},
        )
    return None


def telemetry_gap(
    node: str, rank: int, beat_age_s: float, process_state: str | None
) -> Anomaly | None:
    """A live worker whose heartbeat stopped (stopped by a signal, or its monitor thread stuck)."""
    if beat_age_s < (HEARTBEAT_GAP_S if process_state == "stopped" else TELEMETRY_GAP_S):
        return None
    return Anomaly(
        "telemetry_gap",
        Severity.WARNING,
        f"rank {rank}: no heartbeat for {beat_age_s:.1f} s "
        f"(process state {process_state or 'unknown'})",
        [node],
        [rank],
        {"beat_age_s": round(beat_age_s, 2), "process_state": process_state},
    )


def log_signature(node: str, rank: int, pattern, line: str) -> Anomaly:
    """A classified log line (see transom.monitor.patterns)."""
    return Anomaly(
        pattern.type,
        Severity(pattern.severity),
        f"rank {rank} log: {line.strip()[:200]}",
        [node],
        [rank],
        {"line": line.strip()[:500]},
        hardware=pattern.hardware,
    )


# -- across nodes (controller) ------------------------------------------------------------------


def rank_views(
    summaries: dict[str, MonitorSummary],
    generation: int,
    now: float,
    ages: dict[str, float] | None = None,
) -> list[dict]:
    """Flatten agents' summaries of `generation` into one dict per rank, ages taken at `now`.

    `ages`: each summary's age on the observer's clock (since it saw it change); without it
    (or a node in it), `now - s.t`, which is right only when both clocks agree."""
    views = []
    for node, s in summaries.items():
        if s.generation != generation:
            continue
        lag = ages[node] if ages is not None and node in ages else max(0.0, now - s.t)
        for rank, r in s.ranks.items():
            views.append(
                {
                    **r.to_dict(),
                    "node": node,
                    "rank": int(rank),
                    "step_age": (r.step_age + lag) if r.step_age is not None else None,
                    "beat_age": (r.beat_age + lag) if r.beat_age is not None else None,
                }
            )
    return views


def hang(views: list[dict], floor_s: float) -> Anomaly | None:
    """No rank progressed for the learned timeout (at least `floor_s`, the spec's hang floor);
    blame the ranks that stopped, else those behind."""
    stepping = [v for v in views if v.get("step") is not None and v.get("step_age") is not None]
    if not stepping or len(stepping) < len(views):
        return None  # some rank has not finished a first step yet: start-up, not a hang
    step_times = [v["step_s"] for v in stepping if v.get("step_s")]
    timeout = (
        max(floor_s, HANG_STEP_FACTOR * statistics.median(step_times)) if step_times else floor_s
    )
    if any(v.get("phase") for v in views):
        timeout = max(timeout, PHASE_HANG_S)
    quiet = min(v["step_age"] for v in stepping)
    if quiet < timeout:
        return None
    stopped = [v for v in views if v.get("beat_age") is None or v["beat_age"] >= HEARTBEAT_GAP_S]
    newest = max(v["step"] for v in stepping)
    behind = [v for v in stepping if v["step"] < newest]
    suspects, why = (
        (stopped, "heartbeat stopped")
        if stopped
        else (behind, "behind the others")
        if behind
        else ([], "every rank alive and at the same step (stuck in a collective)")
    )
    nodes = sorted({v["node"] for v in suspects})
    named = ", ".join(f"rank {v['rank']} on {v['node']}" for v in suspects) or "none"
    return Anomaly(
        "hang",
        Severity.CRITICAL,
        f"no progress for {quiet:.1f} s (timeout {timeout:.1f} s) at step "
        f"{newest}; suspects: {named} ({why})",
        nodes,
        sorted(v["rank"] for v in suspects),
        {
            "quiet_s": round(quiet, 2),
            "timeout_s": round(timeout, 2),
            "why": why,
            "steps": {v["rank"]: v["step"] for v in stepping},
        },
        step=newest,
    )


def straggler_candidate(views: list[dict]) -> tuple[str, int, dict] | None:
    """The node whose slowest rank's compute time stands out from the other nodes' (median/MAD)."""
    per_node: dict[str, tuple[float, int]] = {}
    for v in views:
        c = v.get("compute_s")
        if c is None:
            continue
        if v["node"] not in per_node or c > per_node[v["node"]][0]:
            per_node[v["node"]] = (c, v["rank"])
    if len(per_node) < STRAGGLER_MIN_NODES:
        return None
    values = [c for c, _ in per_node.values()]
    m, mad = median_mad(values)
    threshold = m + max(STRAGGLER_MADS * MAD_TO_SIGMA * mad, STRAGGLER_MIN_EXCESS * m)
    worst = max(per_node, key=lambda n: per_node[n][0])
    value, rank = per_node[worst]
    if value <= threshold:
        return None
    return (
        worst,
        rank,
        {
            "compute_s": round(value, 4),
            "peer_median_s": round(m, 4),
            "mad_s": round(mad, 4),
            "threshold_s": round(threshold, 4),
            "ratio_x": round(value / m, 2) if m else None,
            "nodes": {n: round(c, 4) for n, (c, _) in per_node.items()},
        },
    )


class StragglerTracker:
    """Raises a straggler only when the same node stands out in consecutive fresh evaluations."""

    def __init__(self, confirmations: int = STRAGGLER_CONFIRMATIONS):
        self.confirmations = confirmations
        self.node: str | None = None
        self.count = 0
        self.last_key: tuple | None = None

    def update(self, views: list[dict]) -> Anomaly | None:
        key = tuple(sorted((v["node"], v["rank"], v.get("step")) for v in views))
        if key == self.last_key:
            return None  # no new samples since the last evaluation
        self.last_key = key
        found = straggler_candidate(views)
        if found is None:
            self.node, self.count = None, 0
            return None
        node, rank, evidence = found
        self.count = self.count + 1 if node == self.node else 1
        self.node = node
        if self.count < self.confirmations:
            return None
        step = max((v["step"] for v in views if v.get("step") is not None), default=None)
        return Anomaly(
            "straggler",
            Severity.WARNING,
            f"{node} (rank {rank}) computes {evidence['ratio_x']}x slower "
            f"than its peers' median ({evidence['compute_s']} s vs {evidence['peer_median_s']} s)",
            [node],
            [rank],
            evidence,
            step=step,
        )
