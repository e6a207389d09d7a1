"""The typed records processes exchange through etcd (and the run directory's event log).

One dataclass per value stored under a key of `common.keys`: `JobRecord` (job), `Plan` (plan),
`NodeRegistration` (nodes/<node>), `NodeStatus` (status/<node>, with its `FailureReport`s),
`MonitorSummary`
(monitor/<node>), `Anomaly` (in summaries and anomaly events), `PreflightResult`
(preflight/<node>, with its `LinkMeasure`s), `LinkAddress` (links/<node>), `MasterAddress`
(plan/master/<gen>), `Event` (events/<seq>).

Every value crosses a process boundary, so `from_dict` validates (see `record_base`): it ignores
keys it does not know (an older or newer writer), and raises `RecordError` on a missing required
field or a value of the wrong type. Records with an `extra` field keep the unknown keys and
write them back. This module must never do I/O or import another transom package but `common`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# Readers import RecordError and parse_all from here, with the records.
from transom.common import env
from transom.common.record_base import DROP_INVALID, Record
from transom.common.record_base import RecordError as RecordError
from transom.common.record_base import parse_all as parse_all
from transom.common.states import JobState, NodeState

# -- the controller's ---------------------------------------------------------------------------


@dataclass
class Eviction(Record):
    reason: str
    time: float
    generation: int
    # The evicted agent process (`NodeRegistration.incarnation`; "": unknown). An agent that
    # starts again under the same node id is another incarnation and may rejoin as a spare.
    incarnation: str = ""


@dataclass
class Incident(Record):
    """An open incident: when it was detected, and members that never started (warm-up timeout)."""

    since: float
    generation: int
    stuck: list[str] = field(default_factory=list)


@dataclass
class NextGeneration(Record):
    """A generation decided but not yet written: the I/O loop looks up its restore step first."""

    members: list[str]
    why: str
    lost: list[str] = field(default_factory=list)  # nodes whose memory tier is gone


@dataclass
class JobRecord(Record):
    """The controller's state (`job`): everything a new leader needs to continue."""

    state: JobState
    generation: int
    members: list[str]
    since: float  # when the job entered `state`... of PENDING: when the job began waiting
    evicted: dict[str, Eviction] = field(default_factory=dict)
    restarts_used: int = 0
    failures: dict[str, list[float]] = field(default_factory=dict)  # node -> failure times
    last_signature: str | None = None
    incident: Incident | None = None
    # True from a restart until its generation runs: a restart is charged once per incident.
    incident_open: bool = False
    reason: str = ""
    updated: float = 0.0
    handled_anomalies: list[str] = field(default_factory=list)
    numerics_steps: list[int] = field(default_factory=list)
    hang_steps: list[int] = field(default_factory=list)
    rollback_before: int | None = None
    restore_step: int | None = None
    restore_before: int | None = None  # the generation's rollback bound (its plan's)
    previous_members: list[str] = field(default_factory=list)  # the generation before's
    # Steps from here, saved by earlier generations, are forgotten once this generation trained
    # (its ranks have loaded by then: they may restore newer steps than restore_step).
    discard_from: int | None = None
    discard_generation: int | None = None  # the generation that set discard_from
    generation_started: float | None = None
    next_generation: NextGeneration | None = None
    # Members taken for dead before their lease expired (transom.control.set_aside): node ->
    # when; evicted if the lease does expire, forgotten (a spare) once it outlived a node TTL.
    set_aside: dict[str, float] = field(default_factory=dict)

    @classmethod
    def new(cls, now: float) -> JobRecord:
        return cls(JobState.PENDING, 0, [], now, reason="waiting for nodes", updated=now)


@dataclass
class Plan(Record):
    """What every agent must run (`plan`)."""

    generation: int
    members: list[str]
    job_state: JobState
    evicted: dict[str, Eviction] = field(default_factory=dict)
    restart_count: int = 0
    restore_step: int | None = None
    restore_before: int | None = None  # after a rollback: the first step not to restore
    # The generation before's members: where its ranks' newest shards and their replicas are
    # (a checkpoint server of a node that replaces one asks them: worker_service `held`).
    previous_members: list[str] = field(default_factory=list)

    def restore_env(self) -> dict[str, str]:
        """The environment that tells this plan's workers what to restore (engine.py)."""
        bounds = {env.RESTORE_STEP: self.restore_step, env.RESTORE_BEFORE: self.restore_before}
        return {name: str(step) for name, step in bounds.items() if step is not None}


# -- the agents' ----------------------------------------------------------------------------------


@dataclass
class NodeRegistration(Record):
    """A live node agent (`nodes/<node>`, under the node's lease)."""

    node: str
    host: str
    pid: int
    since: float
    incarnation: str = ""  # unique to the agent process (a restarted agent has a new one)


class FailureKind(str, Enum):
    """What a node's failure report is about."""

    WORKER = "worker"  # a worker exited non-zero or by a signal (transom.control.failures)
    FENCED = "fenced"  # the agent killed its workers: cut off from etcd (transom.control.fence)
    PREFLIGHT = "preflight"  # the node failed its pre-flight checks: no worker ran


@dataclass
class FailureReport(Record):
    """One failure a node reports with its FAILED status (`NodeStatus.failures`).

    Every field has a default, so a report from an older or newer agent is read as far as it
    goes: a worker failure that does not say it was a peer's is the node's own.
    """

    kind: FailureKind = FailureKind.WORKER
    describe: str = "worker failed"  # one line for people, e.g. "rank 3 exit code 1: ValueError"
    time: float = 0.0  # when the agent saw it (its wall clock)
    # The worker failed only because a peer went away (a consequence, not a cause); a fenced
    # node's too (etcd was out of its reach, not its workers at fault).
    peer_error: bool = False
    rank: int | None = None  # the worker's global rank (a WORKER failure)
    local_rank: int | None = None
    exitcode: int | None = None  # negative: killed by that signal
    signal: str | None = None  # the signal's name, e.g. "SIGKILL"
    signature: str | None = None  # the exception line its log ends with, e.g. "ValueError: bad"
    log: str = ""  # the worker's log file

    def killed(self) -> bool:
        """A worker SIGKILLed (the OOM killer, a person, its node going down): it failed by
        itself, never because a peer did (a collective's watchdog aborts with SIGABRT)."""
        return self.kind is FailureKind.WORKER and self.signal == "SIGKILL" and not self.peer_error


@dataclass
class NodeStatus(Record):
    """What a node's workers do for which generation (`status/<node>`).

    `failures`: why the node FAILED; a report that is not valid is left out (the controller
    reads the rest).
    """

    node: str
    generation: int
    state: NodeState
    time: float
    step: int | None = None
    warm: int = 0
    failures: list[FailureReport] = field(default_factory=list, metadata=DROP_INVALID)
    preflight: PreflightResult | None = None  # a FAILED node's failed checks
    pids: dict[str, int] | None = None  # local rank -> worker pid
    incarnation: str = ""  # the agent process that wrote it (`NodeRegistration.incarnation`)

    def own_fault(self) -> bool:
        """A worker failed by itself (not only because a peer went away)."""
        return any(not f.peer_error for f in self.failures)


@dataclass
class LinkMeasure(Record):
    """What a node's pre-flight link test measured of its link to one peer (control.links)."""

    latency_ms: float  # median round trip of a one-byte ping
    mbps: float  # the best of a few timed transfers, MB/s


@dataclass
class PreflightResult(Record):
    """A node's pre-flight checks and measurements (`preflight/<node>`; control.preflight).

    `link_mbps` and `link_latency_ms` are its best link's (None: no peer measured); `links` what
    it measured of each peer, an entry that is not valid left out (the controller reads the
    rest). `extra` keeps what a newer agent adds."""

    passed: bool
    time: float = 0.0
    problems: list[str] = field(default_factory=list)
    compute_gflops: float | None = None
    disk_write_s: float | None = None
    free_disk_bytes: int | None = None
    free_memory_bytes: int | None = None
    link_mbps: float | None = None
    link_latency_ms: float | None = None
    links: dict[str, LinkMeasure] = field(default_factory=dict, metadata=DROP_INVALID)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LinkAddress(Record):
    """Where a node's link-test server listens (`links/<node>`, under the node's lease)."""

    host: str
    port: int


@dataclass
class MasterAddress(Record):
    """Where generation g's rank 0 listens (`plan/master/<g>`)."""

    addr: str
    port: int


# -- the monitor's --------------------------------------------------------------------------------


class Severity(str, Enum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


@dataclass
class Anomaly(Record):
    """Something wrong, with whom to suspect and why.

    `type`: crash | peer_exit | hang | straggler | nan | loss_spike | throughput_drop |
    telemetry_gap | a log pattern's type (transom.monitor.patterns). `id` and `generation` are
    set by whoever publishes it.
    """

    type: str
    severity: Severity
    message: str
    nodes: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)
    step: int | None = None
    hardware: bool = False  # a signature of a bad node
    id: str = ""
    generation: int | None = None


@dataclass
class RankSummary(Record):
    """One rank in a monitor summary; ages are seconds at the summary's time `t`."""

    step: int | None = None
    phase: str | None = None
    step_age: float | None = None
    beat_age: float | None = None
    step_s: float | None = None
    compute_s: float | None = None
    wait_s: float | None = None  # median time in the sync section (waiting for the slowest rank)
    busy_s: float | None = None  # time between steps' ends less the wait, trimmed mean (waiting)
    stall_s: float | None = None  # recurring stalls' excess busy time a step (rank_timing)
    stopped_s: float | None = None  # time a step its process did not run (stopped_time)
    # The newest replica fingerprints: step (as a string) -> digest (transom.monitor.fingerprint).
    fingerprints: dict[str, str] = field(default_factory=dict)
    # Of those fingerprinted again (a replay): step -> the largest differences from the rank's
    # earlier parameters of that step, [element index, rounding units] (transom.monitor.evidence).
    deviations: dict[str, list[list[int | float]]] = field(default_factory=dict)
    tokens_per_s: float | None = None
    # Where the rank is while its node looks hung (transom.monitor.stacks): "stopped", "exited"
    # or "in all_reduce at train.py:57"; None while it makes progress.
    where: str | None = None


@dataclass
class MonitorSummary(Record):
    """A node agent's monitor summary (`monitor/<node>`)."""

    node: str
    generation: int
    t: float
    ranks: dict[str, RankSummary] = field(default_factory=dict)
    anomalies: list[Anomaly] = field(default_factory=list)
    host: dict[str, Any] = field(default_factory=dict)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    # The monitor channel's counters: datagrams accepted and dropped by reason, since the start.
    datagrams: dict[str, int] = field(default_factory=dict)
    # The id of the newest `SummaryRequest` this node's summaries answered ("": none).
    answers: str = ""


@dataclass
class SummaryRequest(Record):
    """The controller asks every member of generation `generation` for a fresh monitor summary
    (`plan/summaries`): a rule that waits on what every rank did (the earliest step of a NaN)
    learns it now, not at the summaries' next keep-alive. `id` names the request (the anomaly
    that made it); each summary written for it says so in `MonitorSummary.answers`."""

    generation: int
    id: str


# -- events ---------------------------------------------------------------------------------------


class EventKind(str, Enum):
    LEADER = "leader"  # a controller took the lead
    GENERATION = "generation"  # a generation's plan was written
    RUNNING = "running"  # every member runs it
    INCIDENT = "incident"  # it stopped: lost / failed / stuck members, or an acting anomaly
    DIAGNOSIS = "diagnosis"  # the incident's blame
    EVICT = "evict"
    SPARE = "spare"
    ANOMALY = "anomaly"
    WARNING = "warning"
    DECISION = "decision"  # the policy's action on an anomaly
    ROLLBACK = "rollback"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PROVISION = "provision"  # the launcher replaced an evicted node
    CHECKPOINT = "checkpoint"
    FAULT = "fault"  # an injected fault fired


@dataclass
class Event(Record):
    """One entry of the decision log (`events/<seq>`, key from `keys.event`).

    `message` is for people; readers use the structured fields. Fields a kind does not use stay
    None (and are not written); `extra` keeps the rest (e.g. a fault's or a checkpoint's details).
    """

    time: float
    kind: EventKind
    message: str
    generation: int | None = None
    controller: str | None = None  # the writer, when a controller
    writer: str | None = None  # the writer, when a node agent
    node: str | None = None  # the node evicted / joining as spare / concerned
    nodes: list[str] | None = None
    members: list[str] | None = None
    spares: list[str] | None = None
    lost: list[str] | None = None  # members whose lease expired
    failed: list[str] | None = None  # members that reported a failure
    stuck: list[str] | None = None  # members that did not start workers in time
    blamed: list[str] | None = None
    cause: str | None = None  # a diagnosis's summary of what happened
    restore_step: int | None = None
    rollback_before: int | None = None
    detection: float | None = None  # when the incident was detected
    observed: float | None = None  # when the anomaly was observed
    action: str | None = None
    anomaly: str | None = None  # the id of the anomaly decided on
    anomaly_type: str | None = None
    preflight: PreflightResult | None = None  # an exclusion's evidence
    # an anomaly event's copy of the anomaly
    id: str | None = None
    type: str | None = None
    severity: Severity | None = None
    ranks: list[int] | None = None
    evidence: dict[str, Any] | None = None
    step: int | None = None
    hardware: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().to_dict().items() if v is not None}

    @classmethod
    def of_anomaly(cls, a: Anomaly, time_s: float, **fields: Any) -> Event:
        """The event that records anomaly `a` (observed at `a.time`)."""
        return cls(
            time_s,
            EventKind.ANOMALY,
            f"{a.type}: {a.message}",
            generation=a.generation,
            observed=a.time,
            id=a.id,
            type=a.type,
            severity=a.severity,
            nodes=a.nodes,
            ranks=a.ranks,
            evidence=a.evidence,
            step=a.step,
            hardware=a.hardware,
            **fields,
        )
