"""The job spec: what to run, on how many nodes, with which fault-tolerance budget.

`JobSpec` is the one definition of a job's configuration. Each field a user sets carries its
command-line option (flag, help, argparse type) in its `dataclasses.field` metadata, so
`add_job_options` builds the options of `transom run` and `transom controller` from the
dataclass and `JobSpec.from_args` builds the spec back from the parsed arguments; defaults
live in the dataclass only. `JobSpec.validate()` turns every bad input into a `ConfigError`
with a one-line message before anything is started. A spec read back from etcd crossed a
process boundary: `JobSpec.from_dict` checks every field's type (a `ConfigError` too), and its
readers validate it before they act on it (transom.store.spec).

This module must never do I/O beyond checking the script and the run directory, and never
import other transom subpackages except transom.common.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transom.common import sizes
from transom.common.fault_spec import Fault
from transom.common.names import BadId, check_id
from transom.common.record_base import Record, RecordError

# Simulated nodes are real processes on one machine; more than this would swamp it.
MAX_SIMULATED_NODES = 64
# --node-ttl's default: how long a dead node goes unnoticed at most. 8 s, not 4 (issue 44): its
# lease is renewed twice a TTL (store.etcd_client.REFRESHES_PER_TTL), so every node costs etcd
# one renewal every 4 s; its fence pauses workers 6 s into an etcd stall (control.fence).
NODE_TTL_S = 8


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


def parse_size(text: str) -> int:
    """`transom.common.sizes.parse_size`, its error a ConfigError."""
    try:
        return sizes.parse_size(text)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def new_job_id() -> str:
    return "job-" + uuid.uuid4().hex[:8]


# -- command-line options, declared on the fields they set ------------------------------------

OPTION = "option"  # the dataclasses.field metadata key that holds a field's `Option`

# Help-output groups of the options, in the order --help shows them.
GROUP_JOB = "job"
GROUP_TOLERANCE = "fault tolerance"
GROUP_CKPT = "checkpoints"
GROUP_FAULTS = "fault injection (tests, benchmarks, demos)"
GROUPS = (GROUP_JOB, GROUP_TOLERANCE, GROUP_CKPT, GROUP_FAULTS)


@dataclass(frozen=True)
class Option:
    """How one JobSpec field is set on the command line.

    `parse` turns the option's text into the field's value, or for an option that sets several
    fields (`--nnodes`) into a tuple matching `sets`. Without `parse`, `type` is argparse's
    (default: the type of the field's default). `default_help` describes the default in words
    where the value alone would not say it; otherwise "(default VALUE)" is added to the help.
    """

    flag: str
    help: str
    group: str = GROUP_JOB
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    action: str | None = None
    choices: tuple[Any, ...] | None = None
    parse: Callable[[str], Any] | None = None
    sets: tuple[str, ...] = ()
    default_help: str | None = None


def option(flag: str, help: str, **kwargs: Any) -> dict[str, Option]:
    """Metadata for `dataclasses.field` that makes the field a command-line option."""
    return {OPTION: Option(flag, help, **kwargs)}


def _absolute_path(text: str) -> str:
    return os.path.abspath(text)


@dataclass
class JobSpec(Record):
    """Everything a controller and its agents need to know about one job."""

    script: str
    script_args: list[str] = field(default_factory=list)
    job_id: str = field(default_factory=new_job_id)
    nnodes_min: int = field(
        default=1,
        metadata=option(
            "--nnodes",
            "active nodes; with MIN:MAX the job goes on with as few as MIN",
            metavar="N|MIN:MAX",
            parse=parse_nnodes,
            sets=("nnodes_min", "nnodes_max"),
        ),
    )
    nnodes_max: int = 1  # set by --nnodes with nnodes_min
    spares: int = field(
        default=0,
        metadata=option("--spares", "hot spare nodes that replace evicted ones", metavar="N"),
    )
    nproc_per_node: int = field(
        default=1, metadata=option("--nproc-per-node", "workers per node", metavar="N")
    )
    max_restarts: int = field(
        default=3,
        metadata=option(
            "--max-restarts",
            "restarts allowed for the whole job, counted once per incident",
            group=GROUP_TOLERANCE,
            metavar="N",
        ),
    )
    evict_window_s: float = field(
        default=300.0,
        metadata=option(
            "--evict-window",
            "a node whose workers fail twice within this window is evicted",
            group=GROUP_TOLERANCE,
            metavar="SECONDS",
        ),
    )
    node_ttl_s: int = field(
        default=NODE_TTL_S,
        metadata=option(
            "--node-ttl",
            "node lease time-to-live: how long a dead node goes unnoticed at most",
            group=GROUP_TOLERANCE,
            metavar="SECONDS",
        ),
    )
    store_outage_s: float = field(
        default=60.0,
        metadata=option(
            "--store-outage",
            "how long the job trains on through an outage of etcd that every node sees "
            "(no restart, no eviction); longer than this, nodes stop their workers",
            group=GROUP_TOLERANCE,
            metavar="SECONDS",
        ),
    )
    join_timeout_s: float = field(
        default=30.0,
        metadata=option(
            "--join-timeout",
            "how long to wait for more than MIN nodes before starting",
            metavar="SECONDS",
        ),
    )
    warmup_timeout_s: float = field(
        default=120.0,
        metadata=option(
            "--warmup-timeout",
            "a generation whose nodes have not all started their workers by then is an "
            "incident (a restart)",
            group=GROUP_TOLERANCE,
            metavar="SECONDS",
        ),
    )
    settle_s: float = field(
        default=0.5,
        metadata=option(
            "--settle-time",
            "after the first failure report, how long to wait for the other nodes' reports "
            "before deciding whom to blame (none after a worker's SIGKILL)",
            group=GROUP_TOLERANCE,
            metavar="SECONDS",
        ),
    )
    hang_floor_s: float = field(
        default=8.0,
        metadata=option(
            "--hang-floor",
            "the shortest time without progress on any rank that counts as a hang",
            group=GROUP_TOLERANCE,
            metavar="SECONDS",
        ),
    )
    warm_workers: bool = field(
        default=True,
        metadata=option(
            "--no-warm-workers",
            "start every worker in a fresh interpreter (default: each agent keeps one "
            "interpreter with torch imported and forks every worker from it, which saves "
            "seconds on the first start and on every restart)",
            action="store_false",
        ),
    )
    auto_monitor: bool = field(
        default=True,
        metadata=option(
            "--no-auto-monitor",
            "install no automatic instrumentation in the workers (default: the worker bootstrap "
            "counts optimizer steps, beats, times collectives and registers a stack dump, so an "
            "unmodified script gets hang and straggler detection)",
            action="store_false",
        ),
    )
    # Faults to inject (transom.faults), resolved against the world size and
    # `fault_seed` when the spec is built from the command line (see `from_args`).
    faults: list[Fault] = field(
        default_factory=list,
        metadata=option(
            "--faults",
            "inject faults: e.g. 'crash@step=40:rank=1,hang@step=80,"
            "slow@step=120:node=node2:factor=2,nan@step=30,log@step=20:rank=0,"
            "kill@step=50:node=node1' or 'random[:count=N][:steps=A-B]'; "
            "a file holds one fault a line",
            group=GROUP_FAULTS,
            metavar="SPEC|FILE",
            type=str,
            default_help="none",
        ),
    )
    # The seed the fault schedule was resolved with (kept so a run can be repeated).
    fault_seed: int = field(
        default=0,
        metadata=option(
            "--fault-seed",
            "seed for the ranks (and types and steps with 'random') the fault schedule leaves open",
            group=GROUP_FAULTS,
            metavar="SEED",
        ),
    )
    metrics_port: int = field(
        default=0,
        metadata=option(
            "--metrics-port",
            "the leading controller's Prometheus endpoint: 0 picks a free port (shown by "
            "`transom status`), -1 turns it off",
            metavar="PORT",
        ),
    )
    ckpt_memory_bytes: int | None = field(
        default=None,
        metadata=option(
            "--ckpt-memory",
            "memory budget of each node's checkpoint server, e.g. 16G: its own shards, peers' "
            "replicas and reusable buffers",
            group=GROUP_CKPT,
            metavar="SIZE",
            parse=parse_size,
            default_help="half of the node's memory",
        ),
    )
    ckpt_storage: str | None = field(
        default=None,
        metadata=option(
            "--ckpt-storage",
            "where checkpoint servers persist shards in the background; shared by all nodes",
            group=GROUP_CKPT,
            metavar="DIR",
            parse=_absolute_path,
            default_help="RUN_DIR/checkpoints",
        ),
    )
    ckpt_keep: int = field(
        default=3,
        metadata=option(
            "--ckpt-keep",
            "complete checkpoint steps kept in storage",
            group=GROUP_CKPT,
            metavar="K",
        ),
    )
    ckpt_replicas: int = field(
        default=1,
        metadata=option(
            "--ckpt-replicas",
            "copies of each shard in another node's memory",
            group=GROUP_CKPT,
            choices=(0, 1),
        ),
    )

    def validate(self, check_script: bool = True) -> JobSpec:
        if not self.script or "\0" in self.script:
            raise ConfigError(f"script {self.script!r}: not a file name")
        if any("\0" in arg for arg in self.script_args):
            raise ConfigError("script arguments cannot contain NUL characters")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{_flag_of(f)} {value}: not a number")
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
                f"--spares {self.spares}: more spares than active nodes ({self.nnodes_max}) "
                "makes no sense"
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
        if self.store_outage_s < 0:
            raise ConfigError(f"--store-outage {self.store_outage_s}: cannot be negative")
        if self.join_timeout_s < 0:
            raise ConfigError(f"--join-timeout {self.join_timeout_s}: cannot be negative")
        if self.evict_window_s < 0:
            raise ConfigError(f"--evict-window {self.evict_window_s}: cannot be negative")
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
        try:
            check_id("--job-id", self.job_id)
        except BadId as e:
            raise ConfigError(str(e)) from None
        return self

    @property
    def world_size(self) -> int:
        return self.nnodes_max * self.nproc_per_node

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> JobSpec:
        """The spec of a stored value, every field's type checked (keys it does not know are
        ignored); ConfigError naming what is wrong. Not validated: call `validate()`."""
        try:
            return super().from_dict(data)
        except RecordError as e:
            raise ConfigError(f"not a valid job spec: {e}") from None

    @classmethod
    def from_args(
        cls,
        args: argparse.Namespace,
        resolve_faults: Callable[[str, int, int], list[Fault]] | None = None,
        **fields: Any,
    ) -> JobSpec:
        """The spec from options added by `add_job_options` (not given: the field's default).

        `fields` sets what the options do not (script, script_args, job_id). `--faults` text
        is turned into the fault list by `resolve_faults(text, world_size, fault_seed)`.
        Not validated: call `validate()`.
        """
        values: dict[str, Any] = {}
        for f, opt in job_options():
            text = getattr(args, f.name)
            if text is None:
                continue
            value = opt.parse(text) if opt.parse is not None else text
            if opt.sets:
                values.update(zip(opt.sets, value, strict=True))
            else:
                values[f.name] = value
        faults_text = values.pop("faults", None)
        spec = cls(**(values | fields))
        if faults_text:
            if resolve_faults is None:
                raise ConfigError("--faults cannot be used here")
            spec.faults = resolve_faults(faults_text, spec.world_size, spec.fault_seed)
        return spec


def _flag_of(f: dataclasses.Field) -> str:
    """The option that sets field `f` (its name when it has none)."""
    opt = f.metadata.get(OPTION)
    if opt is not None and (not opt.sets or opt.sets[0] == f.name):
        return opt.flag
    return f.name


def job_options() -> Iterator[tuple[dataclasses.Field, Option]]:
    """The JobSpec fields that are command-line options, in declaration order."""
    for f in dataclasses.fields(JobSpec):
        opt = f.metadata.get(OPTION)
        if opt is not None:
            yield f, opt


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"JobSpec.{f.name} is an option without a default")


def _help(f: dataclasses.Field, opt: Option) -> str:
    if opt.action is not None:  # a switch: its help says what the default is
        return opt.help
    default = opt.default_help
    if default is None:
        value = _default_of(f)
        default = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{opt.help} (default: {default})"


def add_job_options(parser: argparse.ArgumentParser) -> None:
    """Add every JobSpec option to `parser`, grouped for --help; each one's value is None
    when not given, so the dataclass holds the only defaults."""
    groups = {title: parser.add_argument_group(title) for title in GROUPS}
    for f, opt in job_options():
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": _help(f, opt)}
        if opt.action is not None:
            kwargs["action"] = opt.action
        else:
            kwargs["metavar"] = opt.metavar
            if opt.choices is not None:
                kwargs["choices"] = opt.choices
            if opt.parse is not None or opt.type is not None:
                kwargs["type"] = opt.type or str
            else:
                kwargs["type"] = type(_default_of(f))
        groups[opt.group].add_argument(opt.flag, **kwargs)


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
