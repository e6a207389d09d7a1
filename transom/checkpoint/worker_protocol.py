"""The requests a node's workers send its checkpoint server, and the replies: one record each.

Each request is a frozen record whose `op` names it on the wire (protocol.py framing; the message
is `{"op": op, **fields}`, a field that is None left out) and whose `parse` is the one reader of
that request from the socket: it names each field's type and bounds (steps and ranks are
integers >= 0, a shard at most MAX_SHARD_BYTES) and raises ValueError for anything else, so the
server only ever sees a checked record (`parse_request`, a table from op to record). Each request
also names the record its successful reply is (`read_reply`); a reply whose "ok" is not true is a
`Failed`. Both sides turn records into messages with `to_msg` and nothing else.

    Reserve  -> Region     a region to copy a shard into (refused for an older generation)
    Commit   -> Done       the copy is done; the save pipeline takes over
    Abort    -> Done       the copy failed: give the region back
    Persist  -> Done       a shard saved memory-only goes to storage too (Failed: not held)
    Wait     -> Reached    once the shard reached a tier (a timeout is a Failed with `timeout`)
    Locate   -> Located    where the shard can be read, fastest first (`Source` records)
    Prepare  -> Region     a populated spare region for the rank's next save
    Held     -> StepList   steps of a rank's shard held in memory here or by its peers
    Steps    -> StepList   steps restorable for every rank of a world size
    Event    -> Done       a `checkpoint` event on the worker's behalf
    Status   -> Status     what the server holds (a report for people and tests)

This module never does I/O and never decides anything; worker_service.py serves the requests,
client.py and engine.py send them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Self, TypeVar, cast

from transom.checkpoint.protocol import MAX_SHARD_BYTES, field_int
from transom.checkpoint.shard_header import ShardHeader
from transom.common.names import valid_id
from transom.common.record_base import Record, RecordError
from transom.common.states import Tier

# The most sources a `locate` reply may name, and steps a `held` or `steps` reply.
MAX_SOURCES = 1024
MAX_STEPS = 1 << 16


def _short(value: object) -> str:
    return repr(str(value)[:40])


def _field_str(msg: dict[str, Any], name: str, default: str | None = None) -> str:
    value = msg.get(name, default)
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, not {_short(value)}")
    return value


def _optional_int(msg: dict[str, Any], name: str) -> int | None:
    return None if msg.get(name) is None else field_int(msg, name)


def _optional_str(msg: dict[str, Any], name: str) -> str | None:
    return None if msg.get(name) is None else _field_str(msg, name)


def _object(msg: dict[str, Any], name: str) -> dict[str, Any]:
    value = msg.get(name)
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, not {_short(value)}")
    return value


def _steps(msg: dict[str, Any], name: str) -> list[int]:
    value = msg.get(name)
    if (
        not isinstance(value, list)
        or len(value) > MAX_STEPS
        or not all(type(s) is int and s >= 0 for s in value)
    ):
        raise ValueError(f"{name} must be a list of steps, not {_short(value)}")
    return value


@dataclass(frozen=True)
class Message:
    """A record that crosses the worker socket: its fields, None ones left out."""

    def wire_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ShardHeader):
                out[f.name] = value.to_json()
            elif value is not None:
                out[f.name] = value
        return out


# -- replies --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reply(Message):
    """A successful reply: {"ok": true, **fields}."""

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Reply:
        """The reply in a message whose "ok" is true; ValueError when it is not well formed."""
        raise NotImplementedError

    def to_msg(self) -> dict[str, Any]:
        return {"ok": True, **self.wire_fields()}


@dataclass(frozen=True)
class Failed(Message):
    """A request that did not succeed. `refused`: a save the server would not take (memory
    budget, a replaced generation), not a bad request; `timeout`: a `Wait` whose time ran out."""

    error: str
    refused: bool = False
    timeout: bool = False

    def to_msg(self) -> dict[str, Any]:
        return {"ok": False, **self.wire_fields()}

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Failed:
        """Never raises: whatever the server said, cut to a readable length."""
        return cls(
            error=str(msg.get("error", "no reason given"))[:2000],
            refused=msg.get("refused") is True,
            timeout=msg.get("timeout") is True,
        )


@dataclass(frozen=True)
class Done(Reply):
    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Done:
        return cls()


@dataclass(frozen=True)
class Region(Reply):
    """A shared-memory region of `nbytes` at `path` for the worker to map."""

    path: str
    nbytes: int

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Region:
        return cls(_field_str(msg, "path"), field_int(msg, "nbytes", 0, MAX_SHARD_BYTES))


@dataclass(frozen=True)
class Reached(Reply):
    """The tiers the shard has reached."""

    tiers: list[str]

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Reached:
        tiers = msg.get("tiers", [])
        if not isinstance(tiers, list) or not all(isinstance(t, str) for t in tiers):
            raise ValueError(f"tiers must be a list of names, not {_short(tiers)}")
        return cls(tiers)


@dataclass(frozen=True)
class Source(Message):
    """One copy of a shard a loader may read: its tier's name (a `Tier`, or a registered tier's
    own, tiers.py) and where it is. `header` (memory): the shard's header as the server holds it;
    the loader checks it against the step, the rank and the data's checksums."""

    tier: str
    node: str | None = None
    path: str | None = None
    addr: str | None = None
    header: ShardHeader | None = None

    def to_msg(self) -> dict[str, Any]:
        return self.wire_fields()

    @classmethod
    def parse(cls, msg: object) -> Source:
        if not isinstance(msg, dict):
            raise ValueError(f"a source must be an object, not {_short(msg)}")
        node = _optional_str(msg, "node")
        if node is not None and not valid_id(node):
            raise ValueError(f"a source's node is not a node id: {_short(node)}")
        header = msg.get("header")
        return cls(
            tier=_field_str(msg, "tier"),
            node=node,
            path=_optional_str(msg, "path"),
            addr=_optional_str(msg, "addr"),
            header=None if header is None else ShardHeader.from_json(header),
        )


@dataclass(frozen=True)
class Located(Reply):
    sources: list[Source]

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Located:
        sources = msg.get("sources", [])
        if not isinstance(sources, list) or len(sources) > MAX_SOURCES:
            raise ValueError(f"sources must be a list of at most {MAX_SOURCES}")
        return cls([Source.parse(s) for s in sources])

    def to_msg(self) -> dict[str, Any]:
        return {"ok": True, "sources": [s.to_msg() for s in self.sources]}


@dataclass(frozen=True)
class StepList(Reply):
    """Steps, newest first."""

    steps: list[int]

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> StepList:
        return cls(_steps(msg, "steps"))


@dataclass(frozen=True)
class ShardStatus(Record):
    """One shard a server holds, in a `Status` (budget.ShardMemory.status)."""

    step: int
    rank: int
    state: str  # budget's RESERVED, STAGED or COMMITTED
    tiers: list[str] = field(default_factory=list)
    origin: str = ""
    failed: dict[str, str] = field(default_factory=dict)  # tier -> why it failed there


@dataclass(frozen=True)
class PrefetchStatus(Record):
    """What became of one prefetch, in a `Status` (prefetch.Prefetcher.status)."""

    step: int
    rank: int
    outcome: str  # prefetch's FETCHED, SKIPPED, FAILED, or "running"
    detail: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Status(Reply, Record):
    """What the server holds: its node and address, budget use, every shard's state and tiers,
    and what became of its prefetches. A report for people and tests to read, not for the
    worker to act on; `parse` validates it (`Record.from_dict`) all the same."""

    node: str
    addr: str | None = None
    used: int = 0
    budget: int = 0
    free: list[int] = field(default_factory=list)  # the sizes of the free regions
    shards: list[ShardStatus] = field(default_factory=list)
    prefetch: list[PrefetchStatus] = field(default_factory=list)

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Status:
        try:
            return cls.from_dict(msg)
        except RecordError as e:
            raise ValueError(f"a status reply is malformed: {e}") from None

    def to_msg(self) -> dict[str, Any]:
        return {"ok": True, **self.to_dict()}


# -- requests -------------------------------------------------------------------------------------
R = TypeVar("R", bound=Reply)


@dataclass(frozen=True)
class Request(Message, Generic[R]):
    """A request whose successful reply is an R."""

    op: ClassVar[str]
    reply: ClassVar[type[Reply]]

    def to_msg(self) -> dict[str, Any]:
        return {"op": self.op, **self.wire_fields()}

    def read_reply(self, msg: dict[str, Any]) -> R | Failed:
        """The reply to this request in `msg`; ValueError for a successful reply that is not
        well formed."""
        if msg.get("ok") is not True:
            return Failed.parse(msg)
        return cast(R, self.reply.parse(msg))  # `reply` is R: each request names its own


@dataclass(frozen=True)
class Reserve(Request[Region]):
    op = "reserve"
    reply = Region
    step: int
    rank: int
    nbytes: int
    world_size: int
    generation: int | None = None  # under a launcher: the worker's generation
    # Reserved a step ahead of its save (next_region.ReservedAhead): nobody copies into it yet,
    # so the server's background work need not wait for it (pipeline._quiet).
    ahead: bool = False

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Reserve:
        ahead = msg.get("ahead", False)
        if not isinstance(ahead, bool):
            raise ValueError(f"'ahead' must be true or false, not {ahead!r:.40}")
        return cls(
            step=field_int(msg, "step"),
            rank=field_int(msg, "rank"),
            nbytes=field_int(msg, "nbytes", 0, MAX_SHARD_BYTES),
            world_size=field_int(msg, "world_size", 1),
            generation=_optional_int(msg, "generation"),
            ahead=ahead,
        )


@dataclass(frozen=True)
class Commit(Request[Done]):
    op = "commit"
    reply = Done
    step: int
    rank: int
    # The shard's header as JSON (`ShardHeader.to_json`; its checksums are the server's to
    # add): the server reads it with `ShardHeader.from_json` once its tables are back in it.
    header: dict[str, Any]
    persist: bool = True  # False: memory and peer only
    # The number of the header's tensor and storage tables: a header without them names the
    # ones its connection sent with this number before (header_tables.py).
    tables: int | None = None

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Commit:
        if not isinstance(msg.get("header"), dict):
            raise ValueError("commit needs the shard's header (an object)")
        persist = msg.get("persist", True)
        if not isinstance(persist, bool):
            raise ValueError(f"persist must be true or false, not {_short(persist)}")
        step, rank, tables = (
            field_int(msg, "step"),
            field_int(msg, "rank"),
            _optional_int(msg, "tables"),
        )
        return cls(step, rank, msg["header"], persist, tables)


@dataclass(frozen=True)
class ShardRequest(Request[Done]):
    reply = Done  # a request about one shard, answered by Done
    step: int
    rank: int

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Self:
        return cls(field_int(msg, "step"), field_int(msg, "rank"))


@dataclass(frozen=True)
class Abort(ShardRequest):
    op = "abort"


@dataclass(frozen=True)
class Persist(ShardRequest):
    op = "persist"


@dataclass(frozen=True)
class Wait(Request[Reached]):
    op = "wait"
    reply = Reached
    step: int
    rank: int
    tier: Tier
    timeout: float | None = None  # seconds; None: no limit

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Wait:
        timeout = msg.get("timeout")
        if timeout is not None and (
            type(timeout) not in (int, float) or not 0 <= timeout < float("inf")
        ):
            raise ValueError(f"timeout must be null or seconds >= 0, not {_short(timeout)}")
        return cls(
            step=field_int(msg, "step"),
            rank=field_int(msg, "rank"),
            tier=Tier.parse(msg.get("tier")),
            timeout=None if timeout is None else float(timeout),
        )


@dataclass(frozen=True)
class Locate(Request[Located]):
    op = "locate"
    reply = Located
    step: int
    rank: int

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Locate:
        return cls(field_int(msg, "step"), field_int(msg, "rank"))


@dataclass(frozen=True)
class Prepare(Request[Region]):
    op = "prepare"
    reply = Region
    nbytes: int
    rank: int = 0
    # Given (Engine.prepare, before a first save): the kind of the saves to come, so the server
    # prepares a region for each save of their rotation, not one (budget.prepare_spare).
    persist: bool | None = None

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Prepare:
        rank = field_int(msg, "rank") if "rank" in msg else 0
        persist = msg.get("persist")
        if persist is not None and not isinstance(persist, bool):
            raise ValueError(f"'persist' must be true, false or absent, not {persist!r:.40}")
        return cls(field_int(msg, "nbytes", 0, MAX_SHARD_BYTES), rank, persist)


@dataclass(frozen=True)
class Held(Request[StepList]):
    op = "held"
    reply = StepList
    rank: int
    world_size: int
    floor: int
    before: int | None = None

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Held:
        return cls(
            rank=field_int(msg, "rank"),
            world_size=field_int(msg, "world_size", 1),
            floor=field_int(msg, "floor"),
            before=_optional_int(msg, "before"),
        )


@dataclass(frozen=True)
class Steps(Request[StepList]):
    op = "steps"
    reply = StepList
    world_size: int

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Steps:
        return cls(field_int(msg, "world_size", 1))


@dataclass(frozen=True)
class Event(Request[Done]):
    op = "event"
    reply = Done
    action: str = "restored"
    message: str = ""
    fields: dict[str, Any] = field(default_factory=dict)  # the event's own (JSON) fields

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Event:
        fields = msg.get("fields", {})
        if not isinstance(fields, dict) or {"action", "message"} & set(fields):
            raise ValueError("an event's fields are an object without action or message")
        return cls(_field_str(msg, "action", "restored"), _field_str(msg, "message", ""), fields)


@dataclass(frozen=True)
class StatusRequest(Request[Status]):
    op = "status"
    reply = Status

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> StatusRequest:
        return cls()


SaveRequest = Reserve | Commit | Abort | Persist | Wait | Prepare  # a save's requests
OtherRequest = Locate | Held | Steps | Event | StatusRequest  # a load's, and the rest
WorkerRequest = SaveRequest | OtherRequest
_SAVES = (Reserve, Commit, Abort, Persist, Wait, Prepare)
_OTHERS = (Locate, Held, Steps, Event, StatusRequest)
PARSERS: dict[str, Callable[[dict[str, Any]], WorkerRequest]] = {
    kind.op: kind.parse for kind in (*_SAVES, *_OTHERS)
}


def parse_request(msg: dict[str, Any]) -> WorkerRequest:
    """The request in a worker's message; ValueError naming what is wrong with it."""
    op = msg.get("op")
    parse = PARSERS.get(op) if isinstance(op, str) else None
    if parse is None:
        raise ValueError(f"unknown request {_short(op)}")
    return parse(msg)
