"""Detectors: pure functions (and two small stateful trackers) that turn signals into anomalies.

Per-rank detectors (numerics, log lines, telemetry gaps) run in the node agent next to the raw
samples; cross-node detectors (hang here; straggler and throughput drop in
transom.monitor.waiting) run in the controller on the compact per-node summaries the agents
publish (see transom.monitor.node). Every detector returns an
`Anomaly` naming the node(s) and rank(s) to suspect and the evidence. Detectors never act:
what to do about an anomaly is transom.control.policy's decision.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from transom.common.records import Anomaly, FailureReport, MonitorSummary, RankSummary, Severity
from transom.monitor import busy, stacks

__all__ = ["Anomaly"]  # defined in transom.common.records; re-exported for the detectors' users

# Hang: no rank made progress for max(spec.hang_floor_s, HANG_STEP_FACTOR x median step time).
HANG_STEP_FACTOR = 4.0
# While a rank's process is stopped (SIGSTOP, a tracer), its peers can only be waiting for it: a
# hang once no rank progressed for this long, and for stacks.SUSPECT_FRACTION of the learned
# timeout's steps (`suspect_after_s`). A duty cycle that stops a rank now and then (a straggler,
# transom.monitor.stopped_time) never holds every rank this long (the longest stop is
# 300 ms); the hang floor is for ranks that can run, which may be in a long collective or a slow
# step. 2 s until the demo's hang showed the second as a fifth of its downtime.
STOPPED_HANG_S = 1.0
# While a rank is in a phase (checkpoint save, evaluation) a hang takes this long.
PHASE_HANG_S = 300.0
# A hang waits this much past its timeout for every rank's place (transom.monitor.stacks): the
# agents' looks began at half the timeout, and a rank they find at work outside a step
# (transom.monitor.busy) is no hang. Their verdict comes with the places, 0.4 s or so after the
# looks began; a node whose workers have no dump handler never sends places.
PLACES_WAIT_S = 2.0
# A rank whose heartbeat is older than this is stopped or dead (the heartbeat beats every 0.5 s).
HEARTBEAT_GAP_S = 3.0
# Room left under HEARTBEAT_GAP_S for a late agent tick (0.2 s; more on a busy machine), the
# observer's delay and a late heartbeat.
BEAT_MARGIN_S = 1.0
# A rank's heartbeat this old has stopped, as far as its node's agent goes: the agent writes its
# summary at once when a rank's beat passes this age (or comes back), so until it does, the
# summary it last wrote stands for "beating".
BEAT_STOPPED_S = HEARTBEAT_GAP_S - BEAT_MARGIN_S
# A rank whose newest step is younger than STEPPING_STEPS of its step times (STEPPING_MIN_S at
# least) is stepping, as far as its node's agent goes: the agent writes its summary at once when
# a rank stops or starts stepping (`stepping`, transom.control.node_reports), so until it does,
# the summary it last wrote stands for "stepping". A hang's timeout is HANG_STEP_FACTOR steps and
# the hang floor at least: a stepping rank is far from it.
STEPPING_STEPS = 2.0
STEPPING_MIN_S = 1.0
# An agent writes its summary at least this often while it says nothing new (the keep-alive,
# transom.control.node_reports; issue 44: every write is an etcd request on every node; 8 s, not
# 4, since a stepping rank is news when it stops). An observer ages a summary from when it saw it
# change, but a beating rank's heartbeat, and a stepping rank's step, only from when this
# keep-alive ran out (`rank_views`): the agent would have said so had either stopped.
SUMMARY_KEEPALIVE_S = 8.0
# A live, not stopped, rank without heartbeat for this long is a telemetry gap (a process can hold
# Python's lock for seconds, e.g. while tearing down its process group at exit).
TELEMETRY_GAP_S = 10.0
# Loss spike: above median + LOSS_SPIKE_MADS x MAD of the window and LOSS_SPIKE_RATIO x median.
LOSS_WINDOW = 50
LOSS_MIN_SAMPLES = 20
LOSS_SPIKE_MADS = 10.0
LOSS_SPIKE_RATIO = 2.0
MAD_TO_SIGMA = 1.4826


def median_mad(values: Sequence[float]) -> tuple[float, float]:
    m = statistics.median(values)
    return m, statistics.median(abs(v - m) for v in values)


# -- per rank (agent) ---------------------------------------------------------------------------


def crash(node: str, failures: list[FailureReport]) -> Anomaly:
    """Workers exited non-zero or by a signal (failures as transom.control.failures reports them).

    Workers that only saw a peer go away (`peer_error`) are a consequence, not a cause: that is a
    `peer_exit` of severity info, so only the node whose worker failed by itself is suspected.
    """
    own = [f for f in failures if not f.peer_error]
    type_, severity, shown = (
        ("crash", Severity.CRITICAL, own) if own else ("peer_exit", Severity.INFO, failures)
    )
    return Anomaly(
        type_,
        severity,
        "; ".join(f.describe for f in shown),
        nodes=[node],
        ranks=[f.rank for f in shown if f.rank is not None],
        evidence={
            "failures": [
                {
                    "rank": f.rank,
                    "exitcode": f.exitcode,
                    "signal": f.signal,
                    "signature": f.signature,
                    "peer_error": f.peer_error,
                }
                for f in failures
            ]
        },
        time=min(f.time for f in failures),
    )


def numerics(
    node: str, rank: int, step: int, loss: float | None, window: Sequence[float]
) -> Anomaly | None:
    """NaN/Inf loss, or a loss spike against the recent window of finite losses.

    Runs on every step a node's ranks send (40 a second on a fast job), so the window's median
    and MAD (two sorts) are computed only for a loss that could be a spike: a spike is above
    LOSS_SPIKE_RATIO x the median, which for a window of losses that are all >= 0 is at least
    LOSS_SPIKE_RATIO x its smallest; a loss at or below that is none."""
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
        lowest = min(window)
        if lowest >= 0.0 and loss <= LOSS_SPIKE_RATIO * lowest:
            return None
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


def stepping(r: RankSummary) -> bool:
    """Whether a summary shows rank `r` stepping: its newest step younger than STEPPING_STEPS of
    its step times, and than STEPPING_MIN_S at least."""
    if r.step_age is None or r.step_s is None:
        return False
    return r.step_age < max(STEPPING_MIN_S, STEPPING_STEPS * r.step_s)


def rank_views(
    summaries: dict[str, MonitorSummary],
    generation: int,
    now: float,
    ages: dict[str, float] | None = None,
) -> list[dict]:
    """Flatten agents' summaries of `generation` into one dict per rank, ages taken at `now`.

    `ages`: each summary's age on the observer's clock (since it saw it change); without it
    (or a node in it), `now - s.t`, which is right only when both clocks agree. A step's age
    grows by the summary's, and a heartbeat's, unless the summary said the rank was stepping
    (`stepping`) or beating: then only by what is past SUMMARY_KEEPALIVE_S (the agent writes at
    once when a rank stops stepping or its beat stops, so until the keep-alive is due, the rank's
    step and heartbeat are known to within their thresholds)."""
    views = []
    for node, s in summaries.items():
        if s.generation != generation:
            continue
        lag = ages[node] if ages is not None and node in ages else max(0.0, now - s.t)
        kept_lag = max(0.0, lag - SUMMARY_KEEPALIVE_S)  # what is past the keep-alive
        for rank, r in s.ranks.items():
            beating = r.beat_age is not None and r.beat_age < BEAT_STOPPED_S
            views.append(
                {
                    **vars(r),  # a RankSummary holds scalars only: its fields are its dict
                    "node": node,
                    "rank": int(rank),
                    "step_age": None
                    if r.step_age is None
                    else r.step_age + (kept_lag if stepping(r) else lag),
                    "beat_age": None
                    if r.beat_age is None
                    else r.beat_age + (kept_lag if beating else lag),
                }
            )
    return views


def hang_timeout_s(floor_s: float, step_times: Sequence[float]) -> float:
    """The learned hang timeout: max(`floor_s`, HANG_STEP_FACTOR x the median step time)."""
    return max(floor_s, HANG_STEP_FACTOR * statistics.median(step_times)) if step_times else floor_s


def suspect_after_s(timeout_s: float, step_times: Sequence[float]) -> float:
    """How long no rank may progress before the agents collect their ranks' stacks, and before
    a hang is declared where one of them is stopped: stacks.SUSPECT_FRACTION of the timeout, or
    of its steps alone (STOPPED_HANG_S at least) where that is shorter. A stopped rank of a job
    of 60 ms steps under an 8 s floor is a hang after 1 s, not 4 s."""
    steps = HANG_STEP_FACTOR * statistics.median(step_times) if step_times else 0.0
    fraction = stacks.SUSPECT_FRACTION
    return min(fraction * timeout_s, max(STOPPED_HANG_S, fraction * steps))


def hang(views: list[dict], floor_s: float) -> Anomaly | None:
    """No rank progressed for the learned timeout (at least `floor_s`, the spec's hang floor),
    or for `suspect_after_s` while a rank's process is stopped (SIGSTOP, a tracer: its peers can
    only be waiting for it) and every rank's agent has said where its ranks are; blame the ranks
    that stopped, else those behind."""
    stepping = [v for v in views if v.get("step") is not None and v.get("step_age") is not None]
    if not stepping or len(stepping) < len(views):
        return None  # some rank has not finished a first step yet: start-up, not a hang
    step_times = [v["step_s"] for v in stepping if v.get("step_s")]
    timeout = hang_timeout_s(floor_s, step_times)
    in_phase = any(v.get("phase") for v in views)
    if in_phase:
        timeout = max(timeout, PHASE_HANG_S)
    # A phase a worker reported (a save, an evaluation) may hold a stopped rank's peers too;
    # a rank its agent found at work (busy) cannot be what a stopped rank waits for.
    reported_phase = any(v.get("phase") not in (None, busy.BUSY_PHASE) for v in views)
    quiet = min(v["step_age"] for v in stepping)
    # Where each rank is, from its agent's stack dump (transom.monitor.stacks), bounded: it
    # crossed a process boundary.
    where = {
        v["rank"]: v["where"][: stacks.MAX_WHERE]
        for v in views
        if isinstance(v.get("where"), str) and v["where"]
    }
    halted = (  # every rank's place is known (each node's agent has collected), one is stopped
        stacks.STOPPED in where.values()
        and len(where) == len(views)
        and quiet
        >= (
            stacks.SUSPECT_FRACTION * timeout
            if reported_phase
            else suspect_after_s(timeout, step_times)
        )
    )
    if quiet < timeout and not halted:
        return None
    beat_stopped = [
        v for v in views if v.get("beat_age") is None or v["beat_age"] >= HEARTBEAT_GAP_S
    ]
    places_due = len(where) < len(views) and quiet < timeout + PLACES_WAIT_S
    if not (halted or beat_stopped) and places_due:
        return None  # the agents' looks say where each rank is, and which are at work
    # ... or its agent found its process stopped or gone (its heartbeat may be younger than that)
    stopped = [
        v
        for v in views
        if v in beat_stopped or where.get(v["rank"]) in (stacks.STOPPED, stacks.GONE)
    ]
    newest = max(v["step"] for v in stepping)
    behind = [v for v in stepping if v["step"] < newest]
    suspects, why = (
        (stopped, "heartbeat stopped" if beat_stopped else "process stopped")
        if stopped
        else (behind, "behind the others")
        if behind
        else ([], "every rank alive and at the same step (stuck in a collective)")
    )
    nodes = sorted({v["node"] for v in suspects})
    named = ", ".join(f"rank {v['rank']} on {v['node']}" for v in suspects) or "none"
    evidence: dict = {
        "quiet_s": round(quiet, 2),
        "timeout_s": round(timeout, 2),
        "why": why,
        "steps": {v["rank"]: v["step"] for v in stepping},
    }
    if where:
        evidence["where"] = where
    return Anomaly(
        "hang",
        Severity.CRITICAL,
        f"no progress for {quiet:.1f} s (timeout {timeout:.1f} s) at step "
        f"{newest}; suspects: {named} ({why})"
        + (f"; {stacks.group_where(where)}" if where else ""),
        nodes,
        sorted(v["rank"] for v in suspects),
        evidence,
        step=newest,
    )
