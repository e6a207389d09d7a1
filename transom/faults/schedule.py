"""The fault schedule: parsing and validating `--faults`, and seeded random schedules.

A schedule is a comma-separated list of
FAULT@step=N[:rank=R][:node=NODE][:factor=F][:period=S][:line=TEXT] (the fault types are in
registry.py; corrupt's factor is spelt bits=K), e.g.
"crash@step=40:rank=1,hang@step=80,slow@step=120:node=node2:factor=2", or
"random[:count=N][:steps=A-B]" for N faults of random types, ranks and steps (--fault-seed), or
the path of a file holding such items, one a line. A fault without a rank or node gets a random
rank from the seed. `read_fault` reads a scheduled fault back (the spec, a worker's FAULTS) and
checks its type against the registry. This module must never fire a fault: it only turns text
into `Fault`s.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from transom.common.fault_spec import DEFAULT_FACTOR, DEFAULT_LOG_LINE, Fault
from transom.common.record_base import RecordError
from transom.faults.registry import FAULT_TYPES, RANDOM_TYPES
from transom.job_spec import ConfigError

RANDOM_COUNT = 3
RANDOM_STEPS = (10, 100)
KEYS = {"step", "rank", "node", "factor", "period", "bits", "line"}


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


def _random(item: str, rng: random.Random, world_size: int, first_id: int) -> list[Fault]:
    opts = dict(p.split("=", 1) for p in item.split(":")[1:] if "=" in p)
    try:
        count = int(opts.get("count", RANDOM_COUNT))
        lo, hi = (
            int(x) for x in opts.get("steps", f"{RANDOM_STEPS[0]}-{RANDOM_STEPS[1]}").split("-")
        )
    except ValueError as e:
        raise ConfigError(f"--faults {item!r}: expected random[:count=N][:steps=A-B]") from e
    return [
        Fault(
            f"f{first_id + i}",
            rng.choice(RANDOM_TYPES),
            rng.randint(lo, hi),
            rank=rng.randrange(world_size),
        )
        for i in range(count)
    ]


def _fault(item: str, rng: random.Random, world_size: int, fault_id: str) -> Fault:
    kind, fields = _parse_one(item)
    fault_type = FAULT_TYPES[kind]
    if "bits" in fields:  # corrupt's own spelling of its factor: the bits to flip
        if kind != "corrupt" or "factor" in fields:
            raise ConfigError(f"--faults {item!r}: bits=K is corrupt's, instead of factor")
        fields["factor"] = fields.pop("bits")
    unknown = set(fields) - KEYS
    if fault_type.needs_step:
        if unknown or "step" not in fields:
            raise ConfigError(
                f"--faults {item!r}: needs step=N; unknown keys {sorted(unknown) or 'none'}"
            )
    elif unknown:
        raise ConfigError(f"--faults {item!r}: unknown keys {sorted(unknown)}")
    try:
        step = int(fields.get("step", 0))
        rank = int(fields["rank"]) if "rank" in fields else None
        factor = float(fields.get("factor", DEFAULT_FACTOR))
        period = float(fields["period"]) if "period" in fields else None
    except ValueError as e:
        raise ConfigError(
            f"--faults {item!r}: step and rank are integers, factor and period numbers"
        ) from e
    node = fields.get("node")
    if rank is not None and not 0 <= rank < world_size:
        raise ConfigError(
            f"--faults {item!r}: rank {rank} is outside the world (size {world_size})"
        )
    fault = Fault(
        fault_id, kind, step, rank, node, factor, fields.get("line", DEFAULT_LOG_LINE), period
    )
    problem = fault_type.validate(fault)
    if problem:
        raise ConfigError(f"--faults {item!r}: {problem}")
    if fault.rank is None and fault.node is None:
        fault.rank = rng.randrange(world_size)
    return fault


def parse_schedule(spec: str, world_size: int, seed: int = 0) -> list[Fault]:
    """The schedule's faults (ranks resolved), or ConfigError for bad input."""
    text = spec.strip()
    if os.path.isfile(text):
        text = Path(text).read_text().strip().replace("\n", ",")
    rng = random.Random(seed)
    faults: list[Fault] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if item.split(":")[0] == "random":
            faults += _random(item, rng, world_size, len(faults))
        else:
            faults.append(_fault(item, rng, world_size, f"f{len(faults)}"))
    return faults


def read_fault(data: Any) -> Fault:
    """A scheduled fault read back (a worker's FAULTS, a worker's report of one it fired): its
    fields checked (`Fault.from_dict`) and its type a registered one; RecordError if not."""
    fault = Fault.from_dict(data)
    check_type(fault)
    return fault


def check_type(fault: Fault) -> None:
    """RecordError unless `fault`'s type is a registered one and its period, if it has one, a
    positive finite number of seconds."""
    if fault.type not in FAULT_TYPES:
        raise RecordError(f"{fault.type!r} is not a fault type (one of {', '.join(FAULT_TYPES)})")
    if fault.period is not None and not 0 < fault.period < float("inf"):
        raise RecordError(f"fault {fault.id}: period {fault.period!r} is not a positive number")
