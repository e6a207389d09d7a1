"""A shard's resharding record as a typed value: `ReshardRecord` and the `ShardedTensor`s in it.

reshard.py writes the record into a shard's header at save time and reads it back to reshard a
load; the header (shard_header.py) carries it through files, peer frames and worker messages, so
`ReshardRecord.from_json` is its one reader and trusts nothing: a value of the wrong type, a path
that is not a list of strings and integers, a chunk without one offset per dimension of its
global shape or whose split dimension is not one of its dimensions is a `RecordError` naming
what is wrong. The JSON is what it always was (`to_json`):
    {"replicated": [path, ...], "sharded": [[path, {"global_shape": [...], "offsets": [...],
                                                    "dim": d | null}], ...]}
    {"dcp": true}                 a torch.distributed.checkpoint shard (dcp.py)
What the paths mean is reshard.py's. This module must never do I/O and never import torch (the
checkpoint server reads headers without it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transom.common.record_base import RecordError

PathKey = str | int  # a dict key or list index on the way from a state's root
Path = tuple[PathKey, ...]


def _short(value: object) -> str:
    return repr(str(value)[:60])


def _ints(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(n) is int and n >= 0 for n in value):
        raise RecordError(f"{where} must be a list of non-negative integers, not {_short(value)}")
    return tuple(value)


def _path(value: object, where: str) -> Path:
    if not isinstance(value, list) or not all(type(k) in (str, int) for k in value):
        raise RecordError(f"{where} must be a list of strings and integers, not {_short(value)}")
    return tuple(value)


def _list(data: dict[str, Any], name: str) -> list[Any]:
    value = data.get(name, [])
    if not isinstance(value, list):
        raise RecordError(f"resharding record's {name} must be a list, not {_short(value)}")
    return value


@dataclass(frozen=True)
class ShardedTensor:
    """Where one rank's saved chunk of a DTensor lies: the tensor's global shape, the chunk's
    offsets in it, and the dimension a 1-D mesh splits it along (`Shard(d)`; None for other
    meshes)."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    dim: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "global_shape": list(self.global_shape),
            "offsets": list(self.offsets),
            "dim": self.dim,
        }

    @classmethod
    def from_json(cls, value: object, where: str = "sharded tensor") -> ShardedTensor:
        """The chunk described by a JSON value; RecordError when it is not one."""
        if not isinstance(value, dict):
            raise RecordError(f"{where} must be an object, not {_short(value)}")
        shape = _ints(value.get("global_shape"), f"{where}'s global_shape")
        offsets = _ints(value.get("offsets"), f"{where}'s offsets")
        if len(offsets) != len(shape):
            raise RecordError(f"{where} has {len(offsets)} offsets for {len(shape)} dimensions")
        dim = value.get("dim")
        if dim is not None and (type(dim) is not int or not 0 <= dim < len(shape)):
            raise RecordError(f"{where}'s dim must be null or a dimension, not {_short(dim)}")
        return cls(shape, offsets, dim)


@dataclass(frozen=True)
class ReshardRecord:
    """What a shard says about resharding it: the paths of values the same on every rank
    (`replicated`), the DTensors saved as their local chunk and where each lies (`sharded`), or
    that it is a torch.distributed.checkpoint shard (`dcp`: DCP's planner reshards it)."""

    replicated: tuple[Path, ...] = ()
    sharded: tuple[tuple[Path, ShardedTensor], ...] = ()
    dcp: bool = False

    def chunks(self) -> dict[Path, ShardedTensor]:
        """The sharded tensors by path (a path listed twice: its last entry)."""
        return dict(self.sharded)

    def to_json(self) -> dict[str, Any]:
        if self.dcp:
            return {"dcp": True}
        return {
            "replicated": [list(p) for p in self.replicated],
            "sharded": [[list(p), info.to_json()] for p, info in self.sharded],
        }

    @classmethod
    def from_json(cls, value: object) -> ReshardRecord:
        """The record in a decoded JSON value; RecordError naming the first thing wrong with
        it. A missing list is empty; keys it does not know are ignored (a newer writer's)."""
        if not isinstance(value, dict):
            raise RecordError(f"resharding record must be an object, not {_short(value)}")
        dcp = value.get("dcp", False)
        if type(dcp) is not bool:
            raise RecordError(f"resharding record's dcp must be true or false, not {_short(dcp)}")
        replicated = tuple(
            _path(p, f"replicated path {i}") for i, p in enumerate(_list(value, "replicated"))
        )
        sharded = []
        for i, entry in enumerate(_list(value, "sharded")):
            if not isinstance(entry, list) or len(entry) != 2:
                raise RecordError(f"sharded entry {i} must be [path, chunk], not {_short(entry)}")
            path = _path(entry[0], f"sharded path {i}")
            sharded.append((path, ShardedTensor.from_json(entry[1], f"sharded entry {i}")))
        return cls(replicated, tuple(sharded), dcp)
