"""The monitor channel's datagram: its one schema, the encoder workers use, the parser agents use.

A datagram is one JSON object, at most MAX_BYTES long. Every datagram carries `k` (its kind, one
of KINDS), `rank` and `gen` (the sender's global rank and generation) and may carry `t` (the
sender's wall time). The other fields of each kind are in SCHEMA:

    step   step (required), dur / comm / compute (seconds), phase (names), loss, tokens, and up to
           MAX_METRICS more scalar metrics of the worker's own (numbers or null)
    steps  steps (required): 1 to MAX_BATCH step records of the sender, in order, each an object
           with a step datagram's fields and its own `t`, but no `k`, `rank` or `gen` (a fast
           job's steps go out together: transom.monitor.reporter)
    beat   step, phase (a liveness heartbeat)
    phase  step, phase (entering / leaving a checkpoint save, an evaluation, ...)
    fault  step, fault (an injected fault that fired: an object with a string id and type)
    fingerprint  step, fp (a digest of the rank's parameters: transom.monitor.fingerprint), and
           dev when the step was fingerprinted before (a replay): up to MAX_DEVIATIONS pairs
           [element index, rounding units] (transom.monitor.evidence)

Numbers must be finite and in range (a step's comm and compute no longer than its dur), except
`loss` (a NaN or infinite loss is what the numerics detector is for) and the worker's own
metrics. `parse` checks all of it, each record of a `steps` datagram too (one bad record refuses
the datagram), and returns either a `Message` or a `Rejection` naming the
reason (a counter of the node's monitor). Whether the rank belongs to the node and the
generation is current is the listener's check (transom.monitor.node).

This module must never do I/O and `parse` must never raise, whatever bytes it is given.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from transom.monitor import evidence

MAX_BYTES = 16384
MAX_BATCH = 64  # step records in one steps datagram
MAX_RANK = 1 << 20
MAX_GENERATION = 1 << 31
MAX_STEP = 1 << 53
MAX_SECONDS = 7 * 24 * 3600.0  # a step (or a section of one) longer than a week is not real
MAX_WALL_TIME = 1e11  # seconds since the epoch (the year 5138)
MAX_TOKENS = 1e15
MAX_NAME = 64
MAX_PHASES = 8
MAX_METRICS = 16
MAX_DEVIATIONS = evidence.TOP

# Rejection reasons (also the names of the node's counters, with "accepted" and the listener's).
OVERSIZE = "oversize"
NOT_JSON = "not_json"
INVALID = "invalid"


@dataclass(frozen=True)
class Spec:
    """What one field may hold: its type, whether null is allowed, and its range."""

    # "int", "float", "name", "names" (a list of names), "fault", "batch" (of steps),
    # "deviations" ([index, units] pairs)
    type: str
    required: bool = False
    nullable: bool = True
    lo: float = 0.0
    hi: float = math.inf
    finite: bool = True  # floats only: NaN and infinities are refused


def _int(hi: float, required: bool = False) -> Spec:
    return Spec("int", required=required, nullable=not required, hi=hi)


SECONDS = Spec("float", hi=MAX_SECONDS)
NAME_OR_NULL = Spec("name")
# The seconds the sender's process did not run, so far (transom.monitor.stopped_time): on the
# datagrams its sender thread writes (steps, beats, phases).
STOPPED = Spec("float", hi=MAX_WALL_TIME)
COMMON: dict[str, Spec] = {
    "rank": _int(MAX_RANK - 1, required=True),
    "gen": _int(MAX_GENERATION - 1, required=True),
    "t": Spec("float", nullable=False, hi=MAX_WALL_TIME),
}
SCHEMA: dict[str, dict[str, Spec]] = {
    "step": {
        "step": _int(MAX_STEP, required=True),
        "dur": SECONDS,
        "comm": SECONDS,
        "compute": SECONDS,
        "phase": Spec("names"),
        "loss": Spec("float", lo=-math.inf, finite=False),
        "tokens": Spec("float", hi=MAX_TOKENS),
    },
    "steps": {"steps": Spec("batch", required=True, nullable=False), "stopped": STOPPED},
    "beat": {"step": _int(MAX_STEP), "phase": NAME_OR_NULL, "stopped": STOPPED},
    "phase": {"step": _int(MAX_STEP), "phase": NAME_OR_NULL, "stopped": STOPPED},
    "fault": {"step": _int(MAX_STEP), "fault": Spec("fault", required=True, nullable=False)},
    "fingerprint": {
        "step": _int(MAX_STEP, required=True),
        "fp": Spec("name", required=True, nullable=False),
        "dev": Spec("deviations", nullable=False),
    },
}
KINDS = frozenset(SCHEMA)
# The required fields: of every datagram, and of each kind (a batched step record's are a step's).
COMMON_REQUIRED = tuple(name for name, spec in COMMON.items() if spec.required)
REQUIRED: dict[str, tuple[str, ...]] = {
    kind: tuple(name for name, spec in fields.items() if spec.required)
    for kind, fields in SCHEMA.items()
}
# The worker's own metrics (step datagrams only): any number, NaN included, or null.
METRIC = Spec("float", lo=-math.inf, finite=False)


@dataclass
class Message:
    """A valid datagram: its kind, sender, and the kind's fields (absent ones left out; a steps
    datagram's `steps` is a list of step Messages)."""

    kind: str
    rank: int
    generation: int
    t: float | None = None
    values: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rejection:
    """Why a datagram was dropped (`reason`: a counter name) and, for a log line, what."""

    reason: str
    detail: str = ""


class _Invalid(Exception):
    pass


def encode(kind: str, rank: int, generation: int, t: float, /, **values: Any) -> bytes:
    """The datagram a worker sends (for steps, `encode_steps`)."""
    message = {"k": kind, "rank": rank, "gen": generation, "t": t, **_fields(kind, values)}
    return _dump(message)


def encode_steps(
    rank: int, generation: int, records: list[tuple[float, dict]], stopped: float | None = None
) -> bytes:
    """One steps datagram of (time, values) step records: at most MAX_BATCH of them (with
    `stopped`, the sender's stopped seconds so far)."""
    steps = [{"t": t, **_fields("step", values)} for t, values in records[:MAX_BATCH]]
    message = {"k": "steps", "rank": rank, "gen": generation, "steps": steps}
    return _dump(message if stopped is None else message | {"stopped": stopped})


def _fields(kind: str, values: dict[str, Any]) -> dict[str, Any]:
    """A kind's fields of `values`. Of the worker's own metrics (step datagrams) the first
    MAX_METRICS with valid names are kept; one named like a common field is left out."""
    reserved = SCHEMA[kind].keys() | COMMON.keys() | {"k"}
    known = {k: v for k, v in values.items() if k in SCHEMA[kind]}
    if kind != "step":
        return known
    extra = {k: v for k, v in values.items() if k not in reserved and _is_name(k)}
    return known | dict(list(extra.items())[:MAX_METRICS])


def _dump(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def parse(data: bytes) -> Message | Rejection:
    """`data` checked against the schema: a Message, or a Rejection. Never raises."""
    try:
        return _parse(data)
    except _Invalid as e:
        return Rejection(INVALID, str(e)[:200])
    except Exception as e:  # noqa: BLE001 - input from the socket must never raise
        return Rejection(INVALID, f"{type(e).__name__}")


def _parse(data: bytes) -> Message | Rejection:
    if len(data) > MAX_BYTES:
        return Rejection(OVERSIZE, f"{len(data)} bytes")
    try:
        message = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        return Rejection(NOT_JSON, type(e).__name__)
    if not isinstance(message, dict):
        return Rejection(NOT_JSON, f"a JSON {type(message).__name__}, not an object")
    return _message(message)


def _message(message: dict[str, Any]) -> Message:
    kind = message.get("k")
    if not isinstance(kind, str) or kind not in KINDS:
        raise _Invalid(f"unknown kind {str(kind)[:MAX_NAME]!r}")
    values = _checked_fields(kind, message)
    for name in COMMON_REQUIRED:
        if name not in values:
            raise _Invalid(f"missing field {name!r}")
    rank, generation, t = values.pop("rank"), values.pop("gen"), values.pop("t", None)
    if kind == "steps":
        values["steps"] = [_batched_step(record, rank, generation) for record in values["steps"]]
    return Message(kind, rank, generation, t, values)


def _checked_fields(kind: str, message: dict[str, Any]) -> dict[str, Any]:
    """`message`'s fields but `k`, each checked against its spec (the kind's or a common one),
    the kind's required ones present, a step's parts no longer than its duration."""
    fields = SCHEMA[kind]
    values: dict[str, Any] = {}
    metrics = 0
    for name, value in message.items():
        if name == "k":
            continue
        spec = fields.get(name) or COMMON.get(name)
        if spec is None:
            if kind != "step" or not _is_name(name):
                raise _Invalid(f"unknown field {name[:MAX_NAME]!r} in a {kind} datagram")
            metrics += 1
            if metrics > MAX_METRICS:
                raise _Invalid(f"more than {MAX_METRICS} metrics")
            spec = METRIC
        values[name] = _check(name, value, spec)
    for name in REQUIRED[kind]:
        if name not in values:
            raise _Invalid(f"missing field {name!r}")
    duration = values.get("dur")
    for part in ("comm", "compute"):  # parts of the step's duration, never more than it
        if duration is not None and values.get(part) is not None:
            if values[part] > duration * (1 + 1e-6) + 1e-9:
                raise _Invalid(f"{part} is longer than the step (dur)")
    return values


def _batched_step(record: dict[str, Any], rank: int, generation: int) -> Message:
    """One record of a steps datagram, checked as the step datagram it stands for (its sender's
    rank and generation, checked once for the datagram)."""
    if "k" in record or "rank" in record or "gen" in record:
        raise _Invalid("a batched step names its own kind, rank or generation")
    values = _checked_fields("step", record)
    return Message("step", rank, generation, values.pop("t", None), values)


def _check(name: str, value: Any, spec: Spec) -> Any:
    if value is None:
        if not spec.nullable:
            raise _Invalid(f"{name} is null")
        return None
    if spec.type == "float":
        if type(value) not in (int, float):  # bool is refused: type(True) is bool
            raise _Invalid(f"{name} is not a number")
        number = float(value)
        if math.isnan(number) or math.isinf(number):
            if spec.finite:
                raise _Invalid(f"{name} is not finite")
            return number
        if not spec.lo <= number <= spec.hi:
            raise _Invalid(f"{name} is out of [{spec.lo:g}, {spec.hi:g}]")
        return number
    if spec.type == "int":
        if type(value) is not int or not spec.lo <= value <= spec.hi:
            raise _Invalid(f"{name} is not an integer in [{spec.lo:g}, {spec.hi:g}]")
        return value
    if spec.type == "name":
        if not _is_name(value):
            raise _Invalid(f"{name} is not a name")
        return value
    if spec.type == "names":
        if not isinstance(value, list) or len(value) > MAX_PHASES:
            raise _Invalid(f"{name} is not a list of at most {MAX_PHASES} names")
        if not all(_is_name(v) for v in value):
            raise _Invalid(f"{name} holds something else than names")
        return list(value)
    if spec.type == "batch":
        if not isinstance(value, list) or not 1 <= len(value) <= MAX_BATCH:
            raise _Invalid(f"{name} is not a list of 1 to {MAX_BATCH} records")
        if not all(isinstance(record, dict) for record in value):
            raise _Invalid(f"{name} holds something else than objects")
        return value  # each record is checked by _batched_step
    if spec.type == "deviations":
        if not isinstance(value, list) or len(value) > MAX_DEVIATIONS:
            raise _Invalid(f"{name} is not a list of at most {MAX_DEVIATIONS} pairs")
        if not all(evidence.is_deviation(v) for v in value):
            raise _Invalid(f"{name} holds something else than [index, units] pairs")
        return [[int(i), float(u)] for i, u in value]
    if spec.type == "fault":
        if (
            not isinstance(value, dict)
            or not _is_name(value.get("id"))
            or not _is_name(value.get("type"))
        ):
            raise _Invalid(f"{name} is not a fault with a string id and type")
        return value  # its fields are checked against the schedule by the agent's injector
    raise _Invalid(f"{name}: unknown field type {spec.type}")


def _is_name(value: Any) -> bool:
    """A name (of a phase, a metric, a fault): a printable string of at most MAX_NAME characters."""
    return isinstance(value, str) and len(value) <= MAX_NAME and value.isprintable()
