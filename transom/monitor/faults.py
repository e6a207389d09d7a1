"""Fault injection for tests, benchmarks and the demo: a seeded schedule of real faults.

A schedule is a comma-separated list of FAULT@step=N[:rank=R][:node=NODE][:factor=F][:line=TEXT]:
    crash   SIGKILL the rank's worker                  (applied by the agent)
    hang    SIGSTOP the rank's worker                  (applied by the agent)
    log     append a line (default: an Xid error) to the rank's log, as if the worker printed it
    kill    SIGKILL the node's agent and with it its workers (a node death)
    slow    the rank's compute becomes FACTOR x slower (applied in the worker by transom.monitor)
    nan     the rank's loss is multiplied by NaN before backward (applied in the worker)
e.g. "crash@step=40:rank=1,hang@step=80,slow@step=120:node=node2:factor=2", or
"random[:count=N][:steps=A-B]" for N faults of random types, ranks and steps (--fault-seed).
A fault without a rank or node gets a random rank from the seed. A fault fires once in the
whole job, across restarts: the first firing creates `faults/fired/<id>` in etcd, and writes a
`fault` event with its time, type, node, rank and step.

This module must never fire a fault that is not in the schedule.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from transom.config import ConfigError

FAULT_TYPES = ("crash", "hang", "log", "kill", "slow", "nan")
AGENT_FAULTS = ("crash", "hang", "log", "kill")
WORKER_FAULTS = ("slow", "nan")
RANDOM_TYPES = ("crash", "hang", "slow", "nan", "log")
DEFAULT_LOG_LINE = (
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, GPU has fallen off the bus. [transom injected fault]"
)
DEFAULT_SLOW_FACTOR = 2.0
RANDOM_COUNT = 3
RANDOM_STEPS = (10, 100)


@dataclass
class Fault:
    id: str
    type: str
    step: int
    rank: int | None = None
    node: str | None = None
    factor: float = DEFAULT_SLOW_FACTOR
    line: str = DEFAULT_LOG_LINE

    def to_dict(self) -> dict:
        return asdict(self)


def _parse_one(text: str) -> tuple[str, dict]:
    if "@" not in text:
        raise ConfigError(
            f"--faults {text!r}: expected TYPE@step=N[:rank=R][:node=NODE][:factor=F]"
        )
    kind, _, rest = text.partition("@")
    kind = kind.strip()
    if kind not in FAULT_TYPES:
        raise ConfigError(
            f"--faults {text!r}: unknown fault type {kind!r} (one of {', '.join(FAULT_TYPES)})"
        )
    fields: dict = {}
    for part in rest.split(":"):
        key, eq, value = part.partition("=")
        if not eq:
            raise ConfigError(f"--faults {text!r}: {part!r} is not KEY=VALUE")
        fields[key.strip()] = value if key.strip() == "line" else value.strip()
    return kind, fields


def parse_schedule(spec: str, world_size: int, seed: int = 0) -> list[dict]:
    """The schedule as a list of fault dicts (ranks resolved), or ConfigError for bad input."""
    text = spec.strip()
    if os.path.isfile(text):
        text = Path(text).read_text().strip().replace("\n", ",")
    rng = random.Random(seed)
    faults: list[Fault] = []
    items = [t.strip() for t in text.split(",") if t.strip()]
    for item in items:
        if item.split(":")[0] == "random":
            opts = dict(p.split("=", 1) for p in item.split(":")[1:] if "=" in p)
            try:
                count = int(opts.get("count", RANDOM_COUNT))
                lo, hi = (
                    int(x)
                    for x in opts.get("steps", f"{RANDOM_STEPS[0]}-{RANDOM_STEPS[1]}").split("-")
                )
            except ValueError as e:
                raise ConfigError(
                    f"--faults {item!r}: expected random[:count=N][:steps=A-B]"
                ) from e
            for _ in range(count):
                faults.append(
                    Fault(
                        f"f{len(faults)}",
                        rng.choice(RANDOM_TYPES),
                        rng.randint(lo, hi),
                        rank=rng.randrange(world_size),
                    )
                )
            continue
        kind, fields = _parse_one(item)
        unknown = set(fields) - {"step", "rank", "node", "factor", "line"}
        if unknown or "step" not in fields:
            raise ConfigError(
                f"--faults {item!r}: needs step=N; unknown keys {sorted(unknown) or 'none'}"
            )
        try:
            step = int(fields["step"])
            rank = int(fields["rank"]) if "rank" in fields else None
            factor = float(fields.get("factor", DEFAULT_SLOW_FACTOR))
        except ValueError as e:
            raise ConfigError(
                f"--faults {item!r}: step and rank are integers, factor a number"
            ) from e
        node = fields.get("node")
        if rank is not None and not 0 <= rank < world_size:
            raise ConfigError(
                f"--faults {item!r}: rank {rank} is outside the world (size {world_size})"
            )
        if kind == "slow" and factor <= 1.0:
            raise ConfigError(f"--faults {item!r}: factor must be above 1")
        if rank is None and node is None:
            rank = rng.randrange(world_size)
        faults.append(
            Fault(
                f"f{len(faults)}",
                kind,
                step,
                rank,
                node,
                factor,
                fields.get("line", DEFAULT_LOG_LINE),
            )
        )
    return [f.to_dict() for f in faults]


class FaultInjector:
    """The agent's side: fires the schedule's faults aimed at this node once their step is reached."""

    def __init__(self, store, node_id: str, schedule: list[dict]):
        self.store = store
        self.node_id = node_id
        self.generation = 0
        self.schedule = schedule
        self.fired: set[str] = set()

    def refresh_fired(self) -> None:
        if self.schedule:
            self.fired = set(self.store.get_prefix("faults/fired/"))

    def targets_here(self, fault: dict, local_ranks: list[int]) -> list[int]:
        if fault.get("node") is not None:
            return local_ranks if fault["node"] == self.node_id else []
        return [fault["rank"]] if fault.get("rank") in local_ranks else []

    def worker_faults(self, local_ranks: list[int]) -> list[dict]:
        """Unfired in-process faults for this node's ranks, for the workers' TRANSOM_FAULTS."""
        out = []
        for f in self.schedule:
            if f["type"] in WORKER_FAULTS and f["id"] not in self.fired:
                out += [{**f, "rank": r} for r in self.targets_here(f, local_ranks)]
        return out

    def record(
        self, fault: dict, rank: int | None, step: int | None, when: float | None = None
    ) -> bool:
        """Mark `fault` fired (False if it already was) and write its `fault` event."""
        if fault["id"] in self.fired:
            return False
        self.fired.add(fault["id"])
        if not self.store.create(
            f"faults/fired/{fault['id']}", {"node": self.node_id, "rank": rank, "step": step}
        ):
            return False
        when = when or time.time()
        self.store.put(
            f"events/{int(when * 1e9):020d}-{self.node_id}-fault",
            {
                "time": when,
                "kind": "fault",
                "fault": fault["type"],
                "generation": self.generation,
                "id": fault["id"],
                "node": self.node_id,
                "rank": rank,
                "step": step,
                "message": f"injected {fault['type']} on {self.node_id} rank {rank} "
                f"at step {step}" + (f" (x{fault['factor']})" if fault["type"] == "slow" else ""),
            },
        )
        return True

    def fire_due(
        self, steps: dict[int, int], pids: dict[int, int], log_paths: dict[int, Path]
    ) -> None:
        """Fire every agent-side fault whose target rank has reported its trigger step."""
        for f in self.schedule:
            if f["type"] not in AGENT_FAULTS or f["id"] in self.fired:
                continue
            for rank in self.targets_here(f, sorted(steps)):
                if steps.get(rank) is None or steps[rank] < f["step"]:
                    continue
                if not self.record(f, rank, steps[rank]):
                    break
                if f["type"] == "log":
                    with open(log_paths[rank], "a") as log:
                        log.write(f["line"] + "\n")
                elif f["type"] == "crash":
                    _signal(pids[rank], signal.SIGKILL)
                elif f["type"] == "hang":
                    _signal(pids[rank], signal.SIGSTOP)
                elif f["type"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)  # the agent; its workers die with it
                break


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
