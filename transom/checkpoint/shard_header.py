"""The shard header as a typed record: `ShardHeader` and the `Timeline` it was saved under.

A shard's header is JSON written by a worker (layout.py plans it, the checkpoint server adds the
data's checksums) and read back from files, peer frames and worker messages, so it crosses
process and machine boundaries: `ShardHeader.from_json` is its one reader, and it trusts nothing.
It checks every field's type and bounds (step, rank and sizes are integers in range, the world
at least one rank, the storage table inside the data, one checksum per DATA_CHUNK of the data,
tables of plausible length) and raises `ShardError` naming what is wrong - never KeyError or
TypeError from deeper in. What the tensor table's entries and the value tree mean is layout.py's
to check when it rebuilds a state (it knows dtypes and shapes; this module does not). The
resharding record is reshard_record.py's `ReshardRecord`, read with the header; what it means is
reshard.py's.

This module must never do I/O, never import torch or numpy (the checkpoint server starts without
them), and never unpickle, eval or import anything a header names.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from transom.checkpoint.reshard_record import ReshardRecord
from transom.common.record_base import RecordError

FORMAT_VERSION = 1
# Checksums are per chunk of data, so verification runs on several threads and names the bad chunk.
DATA_CHUNK = 64 << 20
MAX_INT = 1 << 62  # any step, rank, size or offset beyond this is a crafted or corrupt header
MAX_WORLD = 1 << 24
MAX_TABLE = 1 << 24  # tensors or storages in one shard
_HEX64 = re.compile(r"[0-9a-f]{16}")


class ShardError(ValueError):
    """A shard that is truncated, corrupt, of another format, or not the one asked for."""


def _short(value: object) -> str:
    return repr(str(value)[:60])


def _int(data: dict[str, Any], name: str, low: int = 0, high: int = MAX_INT) -> int:
    value = data.get(name)
    if type(value) is not int or not low <= value <= high:
        raise ShardError(
            f"shard header's {name} must be an integer in [{low}, {high}], not {_short(value)}"
        )
    return value


def _list(data: dict[str, Any], name: str, default: list[Any] | None = None) -> list[Any]:
    value = data.get(name, default)
    if not isinstance(value, list):
        raise ShardError(f"shard header's {name} must be a list, not {_short(value)}")
    if len(value) > MAX_TABLE:
        raise ShardError(f"shard header's {name} has {len(value)} entries: implausible")
    return value


def chunk_count(data_len: int) -> int:
    """How many DATA_CHUNK checksums cover `data_len` bytes of data."""
    return -(-data_len // DATA_CHUNK)


@dataclass(frozen=True)
class Timeline:
    """The timeline a shard was saved under: its job, the generation that saved it, its world
    size. Shards of one step are one checkpoint only when their timelines are equal."""

    job: str
    generation: int
    world_size: int

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "generation": self.generation, "world_size": self.world_size}

    @classmethod
    def from_json(cls, value: object) -> Timeline:
        """The timeline in a JSON value; ShardError when it is not one."""
        if not isinstance(value, dict):
            raise ShardError(f"a timeline must be an object, not {_short(value)}")
        job = value.get("job")
        if not isinstance(job, str):
            raise ShardError(f"a timeline's job must be a string, not {_short(job)}")
        return cls(job, _int(value, "generation"), _int(value, "world_size", 1, MAX_WORLD))

    @classmethod
    def parse(cls, value: object) -> Timeline | None:
        """The timeline in a JSON value; None when it is missing or malformed (a file that may
        be corrupt: it names no timeline this code can trust)."""
        try:
            return cls.from_json(value)
        except ShardError:
            return None


@dataclass(frozen=True)
class ShardHeader:
    """What a shard says about itself. `tree` and `tensors` are layout.py's (the value tree and
    the tensor table, checked when a state is rebuilt); `storages` is the storage table as
    (offset, nbytes) ranges of the data; `chunks` the xxh3-64 checksums of the data, one per
    DATA_CHUNK (empty until the checkpoint server computed them); `reshard` the resharding record
    reshard.py wrote (None when it wrote none)."""

    step: int
    rank: int
    world_size: int
    data_len: int
    tree: Any = None
    tensors: tuple[dict[str, Any], ...] = ()
    storages: tuple[tuple[int, int], ...] = ()
    timeline: Timeline | None = None
    chunks: tuple[str, ...] = ()
    reshard: ReshardRecord | None = None
    format: int = FORMAT_VERSION

    def with_chunks(self, chunks: list[str]) -> ShardHeader:
        return dataclasses.replace(self, chunks=tuple(chunks))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": self.format,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "tree": self.tree,
            "tensors": list(self.tensors),
            "storages": [{"offset": o, "nbytes": n} for o, n in self.storages],
            "data_len": self.data_len,
        }
        if self.timeline is not None:
            out["timeline"] = self.timeline.to_json()
        if self.reshard is not None:
            out["reshard"] = self.reshard.to_json()
        if self.chunks:
            out["chunks"] = list(self.chunks)
        return out

    @classmethod
    def from_json(cls, data: object) -> ShardHeader:
        """The header in a decoded JSON value; ShardError naming the first thing wrong with it.
        Keys it does not know are ignored (a newer writer's)."""
        if not isinstance(data, dict):
            raise ShardError(f"shard header must be an object, not {_short(data)}")
        version = data.get("format")
        if version != FORMAT_VERSION or type(version) is not int:
            raise ShardError(
                f"shard format {_short(version)} is not supported (this build reads "
                f"{FORMAT_VERSION})"
            )
        data_len = _int(data, "data_len")
        tensors = _list(data, "tensors")
        if not all(isinstance(t, dict) for t in tensors):
            raise ShardError("shard header's tensor table has an entry that is not an object")
        timeline = data.get("timeline")
        reshard = data.get("reshard")
        if reshard is not None and not isinstance(reshard, dict):
            raise ShardError(f"shard header's reshard record is not an object: {_short(reshard)}")
        try:
            record = None if reshard is None else ReshardRecord.from_json(reshard)
        except RecordError as e:
            raise ShardError(f"shard header's reshard record is malformed: {e}") from None
        if "tree" not in data:
            raise ShardError("shard header has no value tree")
        world_size = _int(data, "world_size", 1, MAX_WORLD)
        return cls(
            step=_int(data, "step"),
            rank=_int(data, "rank", 0, world_size - 1),
            world_size=world_size,
            data_len=data_len,
            tree=data["tree"],
            tensors=tuple(tensors),
            storages=_storages(_list(data, "storages"), data_len),
            timeline=None if timeline is None else Timeline.from_json(timeline),
            chunks=_chunks(_list(data, "chunks", []), data_len),
            reshard=record,
        )


def _storages(table: list[Any], data_len: int) -> tuple[tuple[int, int], ...]:
    out = []
    for entry in table:
        if not isinstance(entry, dict):
            raise ShardError(f"shard storage table entry is not an object: {_short(entry)}")
        offset, nbytes = _int(entry, "offset"), _int(entry, "nbytes")
        if offset + nbytes > data_len:
            raise ShardError(
                "shard storage table points outside the data: corrupt or mismatched shard"
            )
        out.append((offset, nbytes))
    return tuple(out)


def _chunks(chunks: list[Any], data_len: int) -> tuple[str, ...]:
    """The data's checksums: none (not computed yet), or exactly one hex xxh3-64 per chunk."""
    if chunks and len(chunks) != chunk_count(data_len):
        raise ShardError(
            f"shard header has {len(chunks)} chunk checksums for {chunk_count(data_len)} chunks"
        )
    if not all(isinstance(c, str) and _HEX64.fullmatch(c) for c in chunks):
        raise ShardError("shard header's chunk checksums are not xxh3-64 hex digests")
    return tuple(chunks)
