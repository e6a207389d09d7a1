"""`WatchedCluster`: what the agents published, followed through etcd watches, not re-read.

The leading controller acts on four of a job's key names: `nodes/` (a node is alive while its
lease-bound registration exists; a lease's expiry arrives as a delete), `status/`, `monitor/`
and `preflight/`. The view reads each once (`start`) and then applies the changes a
`PrefixWatch` delivers, in that watch's own thread (one a name), keeping the parsed records (a
value that is not a valid record counts as absent, as a prefix read's `parse_all` would leave it
out; a registration that is not valid still counts as a live node). After a compaction the
watch hands a full re-read, which replaces that name's records.

It remembers when it received what matters to the controller's clocks (`Observed`): when each
node's monitor summary changed and when a registration was last deleted, on this process's
monotonic clock. An applied change sets `changed`, the event the controller's loop waits on,
except progress reports: a monitor summary without anomalies, or a status that says only that
the node's newest step (or warm interpreters, or its time) moved. Those arrive about every
second from every node; the rules that read them (hang and telemetry-gap ages, stragglers) are
time-based, so the controller's timer takes them in. A summary with an anomaly or in which a
rank's timings shifted (a rank begins to lag: transom.monitor.waiting.timings_shifted) or whose
ranks' places changed (a stuck node's stacks, which a stopped rank's hang waits for), a status
with a new state, generation or failure, any registration or pre-flight change wakes it at once.
News that cannot wait, an incident's first (a status that turned FAILED, a registration
deleted, a stuck node's new places) or a node's workers all done (a status that turned
SUCCEEDED: the job may have ended), also sets `pressing` (the controller's loop then ticks
without its tick floor).

`current` says whether every stream is up: the view is then as new as etcd's watch delivery.
While a stream is down (etcd restarted, unreachable) the view is stale and the controller must
read etcd directly (`read_direct`) instead of taking missing changes for an idle cluster. A
stream that is up but silent because etcd is paused looks current: the controller's own store
contact (transom.control.contact) tells that case apart.

It only reads etcd; it never writes, and its threads never raise into the caller.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from transom.common import keys
from transom.common.records import (
    MonitorSummary,
    NodeRegistration,
    NodeStatus,
    PreflightResult,
    parse_all,
)
from transom.common.states import NodeState
from transom.monitor import waiting
from transom.store import Store
from transom.store.watch import PrefixWatch, Update

log = logging.getLogger("transom.controller")

# A node's status that turned one of these is pressing news (`_pressing`).
PRESSING_STATES = (NodeState.FAILED, NodeState.SUCCEEDED)
# The record type of each watched name.
WATCHED = {
    keys.NODES: NodeRegistration,
    keys.STATUS: NodeStatus,
    keys.MONITOR: MonitorSummary,
    keys.PREFLIGHT: PreflightResult,
}


@dataclass
class Published:
    """The agents' records as of one moment (copies: the caller may keep them)."""

    nodes: dict[str, NodeRegistration | None] = field(default_factory=dict)
    statuses: dict[str, NodeStatus] = field(default_factory=dict)
    summaries: dict[str, MonitorSummary] = field(default_factory=dict)
    preflight: dict[str, PreflightResult] = field(default_factory=dict)
    # When each node's summary reached the view (None: read directly, at the caller's now).
    summary_arrived: dict[str, float] | None = None


def _progress_only(before: Any | None, after: Any | None) -> bool:
    """Whether `after` differs from `before` only in what a running node re-publishes as it
    makes progress (a monitor summary without anomalies whose ranks' timings did not shift; a
    status's time, step, warm count)."""
    if isinstance(after, MonitorSummary):
        shifted = isinstance(before, MonitorSummary) and waiting.summary_shifted(before, after)
        return (
            not after.anomalies
            and not shifted
            and _places(before) == _places(after)
            and not _new_fingerprints(before, after)
            and not _answers(before, after)
        )
    if isinstance(before, NodeStatus) and isinstance(after, NodeStatus):
        same = dataclasses.replace(after, time=before.time, step=before.step, warm=before.warm)
        return same == before
    return False


def _pressing(name: str, before: Any | None, after: Any | None, event: Any) -> bool:
    """Whether a change cannot wait for the controller's tick floor: a registration deleted (a
    node's lease ended), a summary with new places of stuck ranks, a new replica fingerprint
    (a corrupted rank trains on until found) or the answer to a request (a rule waits for it), or
    a node's status that turned FAILED or SUCCEEDED."""
    if name == keys.NODES:
        return bool(event.deleted)
    if isinstance(after, MonitorSummary):
        moved = bool(_places(after)) and _places(after) != _places(before)
        return moved or _new_fingerprints(before, after) or _answers(before, after)
    if not isinstance(after, NodeStatus) or after.state not in PRESSING_STATES:
        return False
    same = (
        isinstance(before, NodeStatus)
        and before.state is after.state
        and before.generation == after.generation
    )
    return not same


def _new_fingerprints(before: Any | None, after: MonitorSummary) -> bool:
    """Whether `after` carries a replica fingerprint its node's `before` did not (the controller
    compares a step's as soon as every rank's is in: transom.monitor.replicas)."""
    old = before.ranks if isinstance(before, MonitorSummary) else {}
    return any(
        r.fingerprints
        and not r.fingerprints.keys() <= getattr(old.get(rank), "fingerprints", {}).keys()
        for rank, r in after.ranks.items()
    )


def _answers(before: Any | None, after: MonitorSummary) -> bool:
    """Whether `after` answers a summary request `before` did not (SummaryRequest)."""
    return bool(after.answers) and after.answers != getattr(before, "answers", "")


def _places(summary: Any | None) -> dict[str, str | None]:
    """Where a summary's ranks are while their node looks hung (none while they progress)."""
    if not isinstance(summary, MonitorSummary):
        return {}
    return {rank: r.where for rank, r in summary.ranks.items() if r.where is not None}


def read_direct(store: Store) -> Published:
    """The same records read with one prefix read per name (StoreError if etcd cannot answer)."""
    registered = store.get_prefix(keys.NODES)
    valid = parse_all(NodeRegistration, registered)
    return Published(
        nodes={n: valid.get(n) for n in registered},
        statuses=parse_all(NodeStatus, store.get_prefix(keys.STATUS)),
        summaries=parse_all(MonitorSummary, store.get_prefix(keys.MONITOR)),
        preflight=parse_all(PreflightResult, store.get_prefix(keys.PREFLIGHT)),
    )


class WatchedCluster:
    """The watched records of one job; `start` it, read it with `published`, `stop` it."""

    def __init__(
        self,
        store: Store,
        changed: threading.Event | None = None,
        pressing: threading.Event | None = None,
    ):
        self.store = store
        self.changed = changed if changed is not None else threading.Event()
        self.pressing = pressing if pressing is not None else threading.Event()
        self._lock = threading.Lock()
        self._records: dict[str, dict[str, Any]] = {name: {} for name in WATCHED}
        self.summary_changed_at: dict[str, float] = {}  # node -> when its summary arrived
        self.node_deleted_at = 0.0  # when a registration was last deleted (0: never)
        self._watches: dict[str, PrefixWatch] = {}

    # -- life ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Read every name and follow it from there (StoreError if etcd cannot be read). Each
        watch hands its first read, then its changes, to `_apply` from its own thread (no
        thread of the view's in between)."""
        try:
            for name in WATCHED:
                apply = functools.partial(self._apply, name)
                watch = PrefixWatch(self.store, name, on_update=apply)
                self._watches[name] = watch
                watch.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for watch in self._watches.values():
            watch.stop()

    @property
    def current(self) -> bool:
        """Every stream is up (a change in etcd reaches the view within the watch's latency)."""
        return bool(self._watches) and all(w.healthy for w in self._watches.values())

    # -- reading -------------------------------------------------------------------------------
    def published(self) -> Published:
        with self._lock:
            records = {name: dict(values) for name, values in self._records.items()}
            arrived = dict(self.summary_changed_at)
        return Published(
            nodes=records[keys.NODES],
            statuses=records[keys.STATUS],
            summaries=records[keys.MONITOR],
            preflight=records[keys.PREFLIGHT],
            summary_arrived=arrived,
        )

    # -- applying ------------------------------------------------------------------------------
    def _parse(self, name: str, node: str, value: Any) -> Any | None:
        return parse_all(WATCHED[name], {node: value}).get(node)

    def _replace(self, name: str, values: dict[str, Any]) -> None:
        now = time.monotonic()
        parsed = {node: self._parse(name, node, value) for node, value in values.items()}
        with self._lock:
            if name == keys.NODES:
                if set(self._records[name]) - set(parsed):
                    self.node_deleted_at = now
                self._records[name] = parsed  # every live node, valid record or not
            else:
                self._records[name] = {n: r for n, r in parsed.items() if r is not None}
            if name == keys.MONITOR:
                for node in self._records[name]:
                    self.summary_changed_at[node] = now
        self.changed.set()

    def _apply(self, name: str, update: Update) -> None:
        if update.snapshot is not None:
            self._replace(name, update.snapshot)
            return
        now = time.monotonic()
        urgent = pressing = False
        with self._lock:
            records = self._records[name]
            for event in update.events:
                record = None if event.deleted else self._parse(name, event.name, event.value)
                urgent = urgent or not _progress_only(records.get(event.name), record)
                pressing = pressing or _pressing(name, records.get(event.name), record, event)
                if event.deleted or (record is None and name != keys.NODES):
                    records.pop(event.name, None)
                    if name == keys.NODES:
                        self.node_deleted_at = now
                else:
                    records[event.name] = record  # a registration counts, valid or not
                if name == keys.MONITOR:
                    self.summary_changed_at[event.name] = now
        if pressing:
            self.pressing.set()
        if urgent:
            self.changed.set()
