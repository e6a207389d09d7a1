"""What a person sees: the job snapshot, `transom status`/`transom events` rendering, live view.

A snapshot is a plain dict of the stored values read from etcd (or from `status.json` in the
run directory after the job ended), so the same rendering serves a live job and a finished one.
Its values are parsed into the records of transom.common.records where they are read (a value
that is not a valid record is left out). This module never writes to etcd.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from transom.common import files, keys
from transom.common.names import natural_key
from transom.common.records import (
    EventKind,
    JobRecord,
    MonitorSummary,
    NodeStatus,
    RecordError,
    parse_all,
)
from transom.common.states import JobState, NodeState

if TYPE_CHECKING:  # the etcd client is imported only by those who read etcd
    from transom.store import Store


def snapshot(store: Store) -> dict:
    """Everything `transom status` shows, read from etcd in a few requests."""
    return _snapshot(store.job_id, store.get, store.get_prefix)


def snapshot_of(job_id: str, values: Mapping[str, Any]) -> dict:
    """The same snapshot, from every value of the job keyed by its name (a `PrefixMirror`'s)."""

    ordered = sorted(values.items())

    def get_prefix(name: str) -> dict[str, Any]:
        return {k[len(name) :]: v for k, v in ordered if k.startswith(name)}

    return _snapshot(job_id, values.get, get_prefix)


def _snapshot(
    job_id: str, get: Callable[[str], Any], get_prefix: Callable[[str], dict[str, Any]]
) -> dict:
    return {
        "job_id": job_id,
        "spec": get(keys.SPEC),
        "job": get(keys.JOB),
        "leader": get(keys.LEADER),
        "nodes": get_prefix(keys.NODES),
        "statuses": get_prefix(keys.STATUS),
        "monitor": get_prefix(keys.MONITOR),
        "preflight": get_prefix(keys.PREFLIGHT),
        "exporter": get(keys.EXPORTER),
        "time": time.time(),
    }


def read_events(store: Store | None = None, run_dir: Path | None = None) -> list[dict]:
    if store is not None:
        return list(store.get_prefix(keys.EVENTS).values())
    assert run_dir is not None, "read events from a store or a run directory"
    path = Path(run_dir) / files.EVENTS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_snapshot(run_dir: Path) -> dict | None:
    path = Path(run_dir) / files.STATUS
    return json.loads(path.read_text()) if path.exists() else None


def node_step(status: NodeStatus | None, summary: MonitorSummary | None) -> int | None:
    """A node's newest finished step: its status's (written when its state changes and at a
    generation's first step) or, when newer, its monitor summary's (written every few steps),
    of the status's generation."""
    return node_step_at(status, summary)[0]


def node_step_at(
    status: NodeStatus | None, summary: MonitorSummary | None
) -> tuple[int | None, float | None]:
    """`node_step`, and when the node reached it as its agent saw it: a running status's time, or
    the summary's time less the rank's step age (None where unknown: a final status is written
    when the workers exited, not at their last step)."""
    if status is None:
        return None, None
    reached: list[tuple[int, float | None]] = []
    if status.step is not None:  # a running status is written at its generation's first step
        reached.append((status.step, status.time if status.state is NodeState.RUNNING else None))
    if summary is not None and summary.generation == status.generation:
        reached += [
            (r.step, summary.t - r.step_age if r.step_age is not None else None)
            for r in summary.ranks.values()
            if r.step is not None
        ]
    if not reached:
        return None, None
    newest = max(step for step, _ in reached)
    times = [at for step, at in reached if step == newest and at is not None]
    return newest, min(times) if times else None


def node_steps(
    snap: dict, statuses: dict[str, NodeStatus] | None = None
) -> dict[str, tuple[int, int | None, float | None]]:
    """Each node's (generation, newest step, when it reached it) in a snapshot (`node_step_at`);
    `statuses`: the snapshot's, parsed already."""
    if statuses is None:
        statuses = parse_all(NodeStatus, snap.get("statuses") or {})
    summaries = parse_all(MonitorSummary, snap.get("monitor") or {})
    return {n: (s.generation, *node_step_at(s, summaries.get(n))) for n, s in statuses.items()}


def progress_record(snap: dict) -> dict | None:
    """One line of progress.jsonl: the job's state, its step (the newest step every member of the
    current generation has finished; None until each has reported one), when the last of them
    reached it (`step_at`, as their agents saw it; None where unknown), the generation's first
    step the same way (`first_step`, `first_step_at`: each member's running status is written at
    its first step, and records are written twice a second, so the newest step has moved on by
    then) and its membership."""
    job = _job(snap)
    if job is None:
        return None
    members, generation = job.members, job.generation
    statuses = parse_all(NodeStatus, snap.get("statuses") or {})
    nodes = node_steps(snap, statuses)
    known = [
        (step, nodes[m][2])
        for m in members
        if m in nodes and nodes[m][0] == generation and (step := nodes[m][1]) is not None
    ]
    step = min(s for s, _ in known) if members and len(known) == len(members) else None
    times = [at for s, at in known if s == step]
    timed = [at for at in times if at is not None]
    first_step, first_step_at = _first_step(statuses, members, generation)
    evicted = sorted(job.evicted, key=natural_key)
    spares = sorted(
        (n for n in snap.get("nodes", {}) if n not in members and n not in evicted), key=natural_key
    )
    return {
        "time": snap.get("time", time.time()),
        "state": job.state.value,
        "generation": generation,
        "step": step,
        "step_at": max(timed) if step is not None and len(timed) == len(times) else None,
        "first_step": first_step,
        "first_step_at": first_step_at,
        "members": members,
        "spares": spares,
        "evicted": evicted,
    }


def _first_step(
    statuses: dict[str, NodeStatus], members: list[str], generation: int
) -> tuple[int | None, float | None]:
    """(step, time): by then every member had finished that step of `generation`, as their
    running statuses (written at each one's first step) say; (None, None) until all have."""
    firsts = [
        (s.step, s.time)
        for m in members
        if (s := statuses.get(m)) is not None
        and s.generation == generation
        and s.state is NodeState.RUNNING
        and s.step is not None
    ]
    if not members or len(firsts) != len(members):
        return None, None
    return min(step for step, _ in firsts), max(at for _, at in firsts)


def _job(snap: dict) -> JobRecord | None:
    try:
        return JobRecord.from_dict(snap["job"]) if snap.get("job") else None
    except RecordError:
        return None


def node_rows(snap: dict) -> list[dict]:
    """One row per node ever seen: role, health, generation, step."""
    job = _job(snap)
    members = job.members if job else []
    evicted = job.evicted if job else {}
    statuses = parse_all(NodeStatus, snap.get("statuses") or {})
    summaries = parse_all(MonitorSummary, snap.get("monitor") or {})
    names = set(snap.get("nodes", {})) | set(statuses) | set(evicted) | set(members)
    rows = []
    for name in sorted(names, key=natural_key):
        status = statuses.get(name)
        alive = name in snap.get("nodes", {})
        if name in evicted:
            role, health = "evicted", evicted[name].reason
        elif name in members:
            ended = job is not None and job.state.terminal
            shown = status.state.value if status else "?"
            role, health = "member", shown if alive or ended else "lost"
        else:
            role, health = "spare", "ready" if alive else "gone"
        nproc = (snap.get("spec") or {}).get("nproc_per_node", 1)
        ranks = (
            f"{members.index(name) * nproc}"
            + (f"-{(members.index(name) + 1) * nproc - 1}" if nproc > 1 else "")
            if name in members
            else None
        )
        rows.append(
            {
                "node": name,
                "role": role,
                "ranks": ranks,
                "health": health,
                "alive": alive,
                "generation": status.generation if status else None,
                "step": node_step(status, summaries.get(name)),
                **monitor_columns(summaries.get(name), job.generation if job else None),
                "link_mbps": ((snap.get("preflight") or {}).get(name) or {}).get("link_mbps"),
            }
        )
    return rows


def monitor_columns(summary: MonitorSummary | None, generation: int | None) -> dict:
    """A node's monitor summary in a row: slowest rank's median step and compute time, throughput,
    and its anomalies in the current generation."""
    if summary is None or summary.generation != generation:
        return {"step_s": None, "compute_s": None, "tokens_per_s": None, "anomalies": []}
    ranks = summary.ranks.values()

    def worst(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    tokens = [r.tokens_per_s for r in ranks if r.tokens_per_s is not None]
    return {
        "step_s": worst([r.step_s for r in ranks]),
        "compute_s": worst([r.compute_s for r in ranks]),
        "tokens_per_s": round(sum(tokens), 1) if tokens else None,
        "anomalies": [a.type for a in summary.anomalies],
    }


def status_summary(snap: dict) -> dict:
    job = _job(snap)
    spec = snap.get("spec") or {}
    steps = [step for _, step, _ in node_steps(snap).values() if step is not None]
    used = job.restarts_used if job else 0
    return {
        "job_id": snap.get("job_id"),
        "state": job.state.value if job else "UNKNOWN",
        "reason": job.reason if job else None,
        "generation": job.generation if job else 0,
        "restarts_used": used,
        "restarts_left": max(0, spec.get("max_restarts", 0) - used),
        "newest_step": max(steps) if steps else None,
        "leader": snap.get("leader"),
        "metrics": (snap.get("exporter") or {}).get("url"),
        "rollback_before": job.rollback_before if job else None,
        "nodes": node_rows(snap),
    }


_STATE_STYLE = {
    JobState.SUCCEEDED.value: "green",
    JobState.FAILED.value: "red",
    JobState.RECOVERING.value: "yellow",
    JobState.RUNNING.value: "cyan",
}
_HEALTH_STYLE = {
    NodeState.RUNNING.value: "green",
    NodeState.SUCCEEDED.value: "green",
    NodeState.FAILED.value: "red",
    "ready": "blue",  # a live spare
    "lost": "red",  # a member whose lease expired
}


def render_status(summary: dict) -> Group:
    head = Text.assemble(
        ("job ", "bold"),
        (summary["job_id"] or "?", "bold"),
        "  ",
        (summary["state"], _STATE_STYLE.get(summary["state"], "white")),
        f"  generation {summary['generation']}",
        f"  restarts left {summary['restarts_left']}",
        f"  newest step {summary['newest_step'] if summary['newest_step'] is not None else '-'}",
        f"  leader {summary['leader'] or '-'}",
    )
    table = Table(box=None, pad_edge=False)
    for column in (
        "node",
        "role",
        "ranks",
        "health",
        "gen",
        "step",
        "step_s",
        "compute_s",
        "tok/s",
        "link MB/s",
        "anomalies",
    ):
        if column == "health":
            table.add_column(column, no_wrap=True, overflow="ellipsis", max_width=20)
        else:
            table.add_column(column, no_wrap=True, min_width=len(column))

    def show(value, fmt="{}"):
        return "-" if value is None else fmt.format(value)

    for r in summary["nodes"]:
        style = "red" if r["role"] == "evicted" else _HEALTH_STYLE.get(r["health"], "white")
        table.add_row(
            r["node"],
            r["role"],
            show(r.get("ranks")),
            Text(str(r["health"]), style=style),
            show(r["generation"]),
            show(r["step"]),
            show(r.get("step_s"), "{:.3f}"),
            show(r.get("compute_s"), "{:.3f}"),
            show(r.get("tokens_per_s"), "{:.0f}"),
            show(r.get("link_mbps"), "{:.0f}"),  # the pre-flight link test's best link
            ", ".join(r.get("anomalies", [])) or "-",
        )
    parts: list[Text | Table] = [head, table]
    for r in summary["nodes"]:
        if r["role"] == "evicted":  # the table cuts long reasons short
            parts.append(Text(f"{r['node']} evicted: {r['health']}", style="red"))
    if summary.get("metrics"):
        parts.append(Text(f"metrics: {summary['metrics']}", style="dim"))
    if summary.get("reason"):
        parts.append(Text(f"reason: {summary['reason']}", style="dim"))
    return Group(*parts)


# Checkpoint progress of every shard: kept in the event log, too many lines for a live view.
ROUTINE_CHECKPOINT_ACTIONS = ("saved", "replicated", "persisted")


def is_routine(event: dict) -> bool:
    """An event a live view leaves out (`transom events` and events.jsonl still have it)."""
    return (
        event.get("kind") == EventKind.CHECKPOINT.value
        and event.get("action") in ROUTINE_CHECKPOINT_ACTIONS
    )


class EventFilter:
    """Which events a live view prints: no routine ones, and each kind of anomaly or warning once
    a generation (a NaN is seen by every rank on every step until the rollback; events.jsonl
    keeps all)."""

    def __init__(self) -> None:
        self._seen: set[tuple] = set()

    def shown(self, event: dict) -> bool:
        if is_routine(event):
            return False
        kind = event.get("kind")
        if kind == EventKind.ANOMALY.value:
            key = (kind, event.get("generation"), event.get("type"))
        elif kind == EventKind.WARNING.value:
            key = (kind, event.get("generation"), event.get("anomaly_type"))
        else:
            return True
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


def render_live(summary: dict, total_steps: int | None = None) -> Group:
    """The live view of `transom run`: a progress bar of training steps above the status table."""
    step = summary["newest_step"] or 0
    if total_steps:
        bar = ProgressBar(total=total_steps, completed=min(step, total_steps), width=50)
        line = Text(
            f" step {step}/{total_steps}  {100 * min(step, total_steps) / total_steps:.0f}%"
        )
    else:
        bar, line = None, Text(f"step {step}")
    head = Table.grid(padding=(0, 1))
    head.add_row(*([bar] if bar is not None else []), line)
    return Group(head, render_status(summary))


def format_event(event: dict) -> str:
    stamp = dt.datetime.fromtimestamp(event["time"]).strftime("%H:%M:%S.%f")[:-3]
    generation = f"g{event['generation']}" if "generation" in event else "-"
    return f"{stamp}  {generation:<4} {event['kind']:<10} {event['message']}"
