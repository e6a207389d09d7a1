"""The job spec: what to run, on how many nodes, with which fault-tolerance budget.

`JobSpec.validate()` turns every bad input into a `ConfigError` with a one-line message
before anything is started.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

MAX_SIMULATED_NODES = 64


class ConfigError(ValueError):
    """Bad user input; the message is shown as is."""


def parse_nnodes(text: str) -> tuple[int, int]:
    """'3' -> (3, 3); '2:4' -> (2, 4), like torchrun's --nnodes."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
    if not m:
        raise ConfigError(f"--nnodes {text!r}: expected N or MIN:MAX")
    low = int(m.group(1))
    high = int(m.group(2)) if m.group(2) is not None else low
    if low < 1:
        raise ConfigError(f"--nnodes {text!r}: at least 1 node is needed")
    if high < low:
        raise ConfigError(f"--nnodes {text!r}: MAX is smaller than MIN")
    return low, high


def new_job_id() -> str:
    return "job-" + uuid.uuid4().hex[:8]


@dataclass
class JobSpec:
    """Everything a controller and its agents need to know about one job."""

    script: str
    script_args: list[str] = field(default_factory=list)
    job_id: str = field(default_factory=new_job_id)
    nnodes_min: int = 1
    nnodes_max: int = 1
    spares: int = 0
    nproc_per_node: int = 1
    max_restarts: int = 3
    # A node whose workers fail twice within this many seconds is evicted.
    evict_window_s: float = 300.0
    # A node agent's lease time-to-live: how long a dead node goes unnoticed at most.
    node_ttl_s: int = 4
    # In PENDING, how long to wait for more than the minimum number of nodes.
    join_timeout_s: float = 30.0
    # A generation whose members have not all started workers by then is an incident.
    warmup_timeout_s: float = 120.0
    # After the first failure report, wait this long for the other nodes' reports.
    settle_s: float = 0.5
    # The shortest time without progress on any rank that counts as a hang.
    hang_floor_s: float = 8.0
    # Keep interpreters with torch already imported ready for each local rank (faster restarts).
    warm_workers: bool = True
    # Faults to inject (transom.monitor.faults), for tests, benchmarks and demos.
    faults: list = field(default_factory=list)
    # The leading controller's Prometheus endpoint port (0: any free one; -1: none).
    metrics_port: int = 0
    # Checkpoint engine: each node's server memory budget (None: half the node's memory), the
    # storage directory (None: RUN_DIR/checkpoints), complete steps kept there, replicas in peer memory.
    ckpt_memory_bytes: int | None = None
    ckpt_storage: str | None = None
    ckpt_keep: int = 3
    ckpt_replicas: int = 1

    def validate(self, check_script: bool = True) -> JobSpec:
        if check_script:
            if not os.path.isfile(self.script):
                raise ConfigError(f"script not found: {self.script}")
            if not os.access(self.script, os.R_OK):
                raise ConfigError(f"script is not readable: {self.script}")
        if self.nnodes_min < 1 or self.nnodes_max < self.nnodes_min:
            raise ConfigError(f"--nnodes {self.nnodes_min}:{self.nnodes_max}: need 1 <= MIN <= MAX")
        if self.spares < 0:
            raise ConfigError(f"--spares {self.spares}: cannot be negative")
        if self.spares > self.nnodes_max:
            raise ConfigError(
                f"--spares {self.spares}: more spares than active nodes ({self.nnodes_max}) makes no sense"
            )
        if self.nproc_per_node < 1:
            raise ConfigError(
                f"--nproc-per-node {self.nproc_per_node}: at least 1 worker per node is needed"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: cannot be negative")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"--metrics-port {self.metrics_port}: a port number, 0 for any, -1 for none"
            )
        if self.node_ttl_s < 2:
            raise ConfigError(f"--node-ttl {self.node_ttl_s}: at least 2 seconds")
        if self.warmup_timeout_s <= 0:
            raise ConfigError(f"--warmup-timeout {self.warmup_timeout_s}: must be positive")
        if not 0 <= self.settle_s <= 30:
            raise ConfigError(f"--settle-time {self.settle_s}: between 0 and 30 seconds")
        if self.hang_floor_s < 1:
            raise ConfigError(f"--hang-floor {self.hang_floor_s}: at least 1 second")
        if self.ckpt_memory_bytes is not None and self.ckpt_memory_bytes <= 0:
            raise ConfigError(f"--ckpt-memory {self.ckpt_memory_bytes}: must be positive")
        if self.ckpt_keep < 1:
            raise ConfigError(
                f"--ckpt-keep {self.ckpt_keep}: at least 1 step must be kept in storage"
            )
        if self.ckpt_replicas not in (0, 1):
            raise ConfigError(f"--ckpt-replicas {self.ckpt_replicas}: 0 or 1")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.job_id):
            raise ConfigError(
                f"--job-id {self.job_id!r}: use letters, digits, '.', '_' and '-' (at most 64)"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.nnodes_max * self.nproc_per_node

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> JobSpec:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def prepare_run_dir(path: str | os.PathLike) -> Path:
    """Create the run directory and prove it is writable, or raise ConfigError."""
    run_dir = Path(path).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run directory {run_dir} cannot be written: {e.strerror or e}") from e
    return run_dir
