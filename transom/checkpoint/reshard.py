"""Resharding restore: a world of W ranks loads a step saved by a world of W' ranks.

What a shard says about itself (its header's `ReshardRecord`, reshard_record.py, written at save
time and checked when the header is read):
    replicated      values the same on every rank (declared by the saver,
                    `Engine.save(..., replicated=("model", "optim"))`, or detected: a DTensor
                    replicated over its mesh)
    sharded         DTensors, saved as their local chunk (`ShardedTensor`): the global shape,
                    where the chunk starts, and the dimension a 1-D mesh splits it along
                    (Shard(d); None for other meshes)
    dcp             a torch.distributed.checkpoint shard (dcp.py): its metadata describes every
                    chunk and DCP's planner reshards
A path is the tuple of dict keys (and list indices) from the state's root; a declared path covers
everything below it (keys compared as strings). Everything neither replicated nor sharded is
per-rank state.

A step is restorable for a world of W ranks (`restorable`) when every rank 0..W-1 holds a shard
saved by a world of W (as before), or when every rank 0..W'-1 of the world that saved it holds a
shard that has a resharding record. `load` then builds rank r's state:
  * replicated values from one saved rank's copy, preferring a shard in this node's memory, then
    whichever the tiers serve (a peer's memory, storage);
  * sharded tensors re-sliced: rank r's slice of the global tensor along the same dimension (the
    DTensor `Shard(d)` rule: chunks of ceil(n / W)), copied from the saved chunks that overlap it
    (only those shards are read); the whole global tensor when the mesh was not 1-D;
  * per-rank values are left out (the caller re-derives them: a data position and RNG state are
    functions of the global step, as in workloads/train_gpt.py); `Engine.last_load.resharded`
    lists them.
It reads shards through the engine's public `ShardReader` calls, never its private members.
This module never pickles, never talks to etcd, and never guesses: a step saved by another world
without a record is not restorable for this one, a malformed record makes its header a
ShardError (a bad copy), and a record that does not match the chunks the shards hold raises
CheckpointError (the loader tries an older step).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from transom.checkpoint import flatten, layout
from transom.checkpoint.client import CheckpointError
from transom.checkpoint.load_record import LoadRecord, Resharded
from transom.checkpoint.reshard_record import Path, ReshardRecord, ShardedTensor
from transom.checkpoint.shard_format import ShardHeader, Timeline
from transom.checkpoint.worker_protocol import Source
from transom.common.states import Tier

# A rank whose own shard is missing (a grown world) asks its server where this many saved ranks'
# shards are, to read the replicated state from one in its node's memory.
PROBE_RANKS = 16


class DcpShard(dict[str, Any]):
    """The state of one rank's torch.distributed.checkpoint shard (dcp.py declares it so)."""


# -- saving ------------------------------------------------------------------------------------


def _declared(paths: Iterable[str | tuple[Any, ...]]) -> list[Path]:
    """The declared paths; a key neither a string nor an integer is recorded as its string (the
    loader compares declared keys as strings)."""
    out = []
    for p in paths:
        keys = [k for k in p.split("/") if k] if isinstance(p, str) else p
        out.append(tuple(k if type(k) in (str, int) else str(k) for k in keys))
    return out


def _covered(path: Path, declared: Collection[Path]) -> bool:
    """`path` is at or below a declared path (keys compared as strings: "optim/state/0")."""
    return any(
        len(d) <= len(path) and all(str(a) == str(b) for a, b in zip(d, path, strict=False))
        for d in declared
    )


def _above(path: Path, declared: Collection[Path]) -> bool:
    """Some declared path lies strictly below `path`."""
    return any(
        len(d) > len(path) and all(str(a) == str(b) for a, b in zip(d, path, strict=False))
        for d in declared
    )


def _dtensor_type() -> type | None:
    """DTensor, when the program has imported it (else no value can be one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def describe(
    state: Any, replicated: Iterable[str | tuple[Any, ...]] = ()
) -> tuple[Any, ReshardRecord | None]:
    """(the state to save, its resharding record or None). DTensors become their local chunk;
    `replicated` names the paths the same on every rank."""
    if isinstance(state, DcpShard):
        return dict(state), ReshardRecord(dcp=True)
    sharded: list[tuple[Path, ShardedTensor]] = []
    rep = _declared(replicated)
    dtensor = _dtensor_type()

    def walk(value: Any, path: tuple[Any, ...]) -> Any:
        if dtensor is not None and isinstance(value, dtensor):
            if not all(type(k) in (str, int) for k in path):
                raise layout.UnsupportedValue(
                    f"cannot record where DTensor {list(map(repr, path))} is: its keys must be "
                    f"strings or integers"
                )
            return _local_chunk(value, path, rep, sharded)
        if isinstance(value, dict):
            new = {k: walk(v, (*path, k)) for k, v in value.items()}
            if all(new[k] is v for k, v in value.items()):
                return value
            out = type(value)(new)
            if hasattr(value, "_metadata"):
                out._metadata = value._metadata  # type: ignore[attr-defined]
            return out
        if type(value) in (list, tuple):
            elems = [walk(v, (*path, i)) for i, v in enumerate(value)]
            if all(a is b for a, b in zip(elems, value, strict=True)):
                return value
            return type(value)(elems)
        return value

    out = walk(state, ()) if dtensor is not None else state
    if not rep and not sharded:
        return out, None
    return out, ReshardRecord(tuple(rep), tuple(sharded))


def _local_chunk(
    t: Any, path: Path, rep: list[Path], sharded: list[tuple[Path, ShardedTensor]]
) -> torch.Tensor:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local: torch.Tensor = t.to_local()
    placements = tuple(t.placements)
    if all(isinstance(p, Replicate) for p in placements):
        rep.append(path)
        return local
    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)
    dim = placements[0].dim if len(placements) == 1 and isinstance(placements[0], Shard) else None
    info = ShardedTensor(tuple(int(n) for n in t.shape), tuple(int(o) for o in offsets), dim)
    sharded.append((path, info))
    return local


def plan_state(
    state: Any,
    step: int,
    rank: int,
    world_size: int,
    replicated: Iterable[str | tuple[Any, ...]] = (),
    timeline: Timeline | None = None,
) -> flatten.Plan:
    """`flatten.plan_state` of the state `describe` makes, its header carrying the record.
    A state without DTensors is planned as it is, without `describe`'s walk."""
    if not isinstance(state, DcpShard):
        try:
            plan = flatten.plan_state(state, step, rank, world_size, timeline, _dtensor_type())
        except flatten.Diverted:
            pass  # a DTensor in it: its local chunk is saved, and where it lies
        else:
            declared = _declared(replicated)
            if declared:
                marked = ReshardRecord(tuple(declared))
                plan.header = dataclasses.replace(plan.header, reshard=marked)
            return plan
    state, record = describe(state, replicated)
    plan = flatten.plan_state(state, step, rank, world_size, timeline)
    if record is not None:
        plan.header = dataclasses.replace(plan.header, reshard=record)
    return plan


@dataclass(frozen=True)
class ShardRead:
    """What `Engine.last_shard` says of the shard a load read last: the size of the world that
    saved it and its resharding record (None where the header has none)."""

    world_size: int | None = None
    record: ReshardRecord | None = None


def load_info(header: ShardHeader) -> ShardRead:
    """The `ShardRead` of a shard's header (read from a file or a peer: checked when read)."""
    return ShardRead(header.world_size, header.reshard)


# -- loading -------------------------------------------------------------------------------------


class ShardReader(Protocol):
    """What a resharding load needs of the worker's checkpoint engine (`Engine`): its place in
    the world, its reads of saved shards, and its events."""

    rank: int
    world_size: int
    last_load: LoadRecord | None  # what the last load read; a resharding load adds `resharded`
    last_shard: ShardRead  # of the shard `read_shard` read last

    def read_shard(self, step: int, tier: str | None, rank: int) -> Any: ...

    def locate(self, step: int, rank: int, timeout: float | None = None) -> list[Source]: ...

    def report_event(self, action: str, message: str, **fields: Any) -> None: ...


def chunk_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of chunk `index` of `n` items split into `parts` (DTensor's Shard rule:
    chunks of ceil(n / parts), the last ones shorter or empty)."""
    size = math.ceil(n / parts) if parts else 0
    start = min(index * size, n)
    return start, min(start + size, n)


def copy_overlap(
    target: torch.Tensor,
    target_offsets: list[int],
    piece: torch.Tensor,
    offsets: list[int],
    filled: torch.Tensor | None = None,
) -> int:
    """Copy the part of `piece` (at global `offsets`) that overlaps `target` (at
    `target_offsets`) into `target`, marking it in `filled` (a bool tensor of target's shape)
    when given; the number of elements copied."""
    if piece.dim() != target.dim() or len(offsets) != piece.dim():
        raise CheckpointError("a saved chunk does not have the tensor's number of dimensions")
    src, dst, mark = piece, target, filled
    for d in range(piece.dim()):
        lo = max(offsets[d], target_offsets[d])
        hi = min(offsets[d] + piece.shape[d], target_offsets[d] + target.shape[d])
        if hi <= lo:
            return 0
        src = src.narrow(d, lo - offsets[d], hi - lo)
        dst = dst.narrow(d, lo - target_offsets[d], hi - lo)
        if mark is not None:
            mark = mark.narrow(d, lo - target_offsets[d], hi - lo)
    dst.copy_(src)
    if mark is not None:
        mark.fill_(True)
    return src.numel()


def _at(state: Any, path: Path) -> Any:
    for key in path:
        state = state[key]
    return state


class _Resharder:
    """Rank `engine.rank`'s state of `step` from shards saved by another world."""

    def __init__(self, engine: ShardReader, step: int, tier: str | None):
        self.engine, self.step, self.tier = engine, step, tier
        self.shards: dict[int, tuple[Any, ReshardRecord]] = {}  # saved rank -> (state, record)
        self.saved_world = 0

    def shard(self, rank: int) -> tuple[Any, ReshardRecord]:
        if rank not in self.shards:
            state = self.engine.read_shard(self.step, self.tier, rank)
            info = self.engine.last_shard
            if info.world_size != self.saved_world or info.record is None:
                raise CheckpointError(
                    f"step {self.step} rank {rank} was saved by a world of "
                    f"{info.world_size} ranks, not {self.saved_world}: mixed checkpoints"
                )
            self.shards[rank] = (state, info.record)
        return self.shards[rank]

    def build(self, base_rank: int, base: Any, record: ReshardRecord) -> Any:
        self.shards[base_rank] = (base, record)
        replicated = list(record.replicated)
        sharded = record.chunks()
        dropped: list[str] = []

        def rebuild(value: Any, path: tuple[Any, ...]) -> tuple[Any, bool]:
            if path in sharded:
                return self.reslice(path, sharded[path], value), True
            if _covered(path, replicated):
                return value, True
            if not _above(path, [*replicated, *sharded]):
                dropped.append("/".join(str(k) for k in path))
                return None, False
            if isinstance(value, dict):
                out = type(value)()
                for k, v in value.items():
                    new, keep = rebuild(v, (*path, k))
                    if keep:
                        out[k] = new
                if hasattr(value, "_metadata"):
                    out._metadata = value._metadata  # type: ignore[attr-defined]
                return out, True
            if isinstance(value, (list, tuple)):
                return type(value)(rebuild(v, (*path, i))[0] for i, v in enumerate(value)), True
            raise CheckpointError(f"step {self.step}: sharded path {path} is not in the state")

        state, _ = rebuild(base, ())
        loaded = self.engine.last_load
        if loaded is not None:  # set by the read of the base rank's shard
            done = Resharded(self.saved_world, base_rank, tuple(dropped))
            self.engine.last_load = dataclasses.replace(loaded, resharded=done)
        return state

    def reslice(self, path: Path, info: ShardedTensor, example: Any) -> torch.Tensor:
        """This rank's slice of a sharded tensor, from the saved chunks that overlap it."""
        rank, world = self.engine.rank, self.engine.world_size
        shape, dim = list(info.global_shape), info.dim  # checked when the header was read
        if not isinstance(example, torch.Tensor):
            raise CheckpointError(f"step {self.step}: {path} does not match its record")
        offsets = [0] * len(shape)
        local = list(shape)
        sources = list(range(self.saved_world))
        if dim is not None:
            offsets[dim], end = chunk_range(shape[dim], world, rank)
            local[dim] = end - offsets[dim]
            sources = [  # the saved chunks that overlap this rank's
                q
                for q in sources
                if max(offsets[dim], chunk_range(shape[dim], self.saved_world, q)[0])
                < min(end, chunk_range(shape[dim], self.saved_world, q)[1])
            ]
        out = torch.empty(local, dtype=example.dtype)
        filled = torch.zeros(local, dtype=torch.bool)
        for q in sources:
            state, record = self.shard(q)
            entry = record.chunks().get(path)
            try:
                piece = _at(state, path)
            except (KeyError, IndexError, TypeError) as e:
                raise CheckpointError(f"step {self.step} rank {q}: bad chunk of {path}: {e}") from e
            if (
                entry is None
                or list(entry.global_shape) != shape
                or not isinstance(piece, torch.Tensor)
                or piece.dtype != out.dtype
            ):
                raise CheckpointError(f"step {self.step} rank {q} holds no chunk of {path} to fit")
            copy_overlap(out, offsets, piece, list(entry.offsets), filled)
        if not bool(filled.all()):
            raise CheckpointError(
                f"step {self.step}: the saved chunks of {path} cover {int(filled.sum())} of "
                f"{out.numel()} elements of rank {rank}'s slice"
            )
        return out


def _memory_ranks(engine: ShardReader, step: int, limit: int) -> list[int]:
    """Saved ranks (below `limit`) whose shard of `step` is in this node's memory."""
    found: list[int] = []
    for rank in range(min(limit, PROBE_RANKS)):
        try:
            sources = engine.locate(step, rank)
        except CheckpointError:
            return found
        if any(s.tier == Tier.MEMORY for s in sources):
            found.append(rank)
    return found


def load(engine: ShardReader, step: int, tier: str | None) -> Any:
    """Rank `engine.rank`'s state of `step`: its own shard when the step was saved by a world of
    this size, else resharded from the saving world's shards; CheckpointError when neither."""
    try:
        state = engine.read_shard(step, tier, engine.rank)
        base_rank = engine.rank
    except CheckpointError as own_error:
        if engine.rank == 0:
            raise
        # A rank the saving world did not have (or whose shard is gone): replicated state from
        # a saved rank's copy, one in this node's memory first.
        base_rank = (_memory_ranks(engine, step, engine.rank) or [0])[0]
        try:
            state = engine.read_shard(step, tier, base_rank)
        except CheckpointError:
            raise own_error from None
        if engine.last_shard.world_size == engine.world_size:
            raise own_error from None  # saved by this world: this rank's shard is missing
    saved_world, record = engine.last_shard.world_size, engine.last_shard.record
    if saved_world == engine.world_size:
        return state
    if record is None or saved_world is None:
        raise CheckpointError(
            f"step {step} was saved by a world of {saved_world} ranks without a resharding "
            f"record; it cannot be loaded by a world of {engine.world_size} (declare the state "
            f"the ranks share: Engine.save(..., replicated=(...)))"
        )
    if record.dcp:
        raise CheckpointError(
            f"step {step} is a torch.distributed.checkpoint: load it with dcp.load and "
            f"transom.checkpoint.dcp.TransomReader, whose planner reshards it"
        )
    resharder = _Resharder(engine, step, tier)
    resharder.saved_world = saved_world
    out = resharder.build(base_rank, state, record)
    loaded = engine.last_load
    dropped = loaded.resharded.dropped if loaded is not None and loaded.resharded else ()
    engine.report_event(
        "resharded",
        f"rank {engine.rank} restored step {step} saved by {saved_world} ranks (now "
        f"{engine.world_size}) from rank {base_rank}'s copy; per-rank values left out: "
        f"{', '.join(dropped) or 'none'}",
        step=step,
        rank=engine.rank,
        from_world_size=saved_world,
    )
    return out
