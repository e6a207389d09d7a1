"""A rank's state as a shard: the tensor table, the data ranges to copy, and the state rebuilt.

The worker's side of the shard format (shard_format.py has its bytes: prefix, JSON header,
checksums). `plan_state` flattens a state into a header and the byte ranges of its tensor
storages; `copy_into` copies them into the data region (each range aligned to STORAGE_ALIGN);
`rebuild` turns a header and a data region back into the state, its tensors viewing the data.

Tensors are saved by the byte range of their storage that they span, so non-contiguous tensors
keep their strides and tensors that are views of one storage come back as views of one storage.
Everything that is not a tensor is encoded as a JSON tree of known node types (containers,
numbers, strings, bytes, dtypes, ...). Only workers import this module (it needs torch); the
checkpoint server never does. This module must never unpickle, eval or import anything named by
a shard: a shard is data, and a crafted one can at worst be rejected with `ShardError`.
"""

from __future__ import annotations

import base64
import math
import mmap
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from transom.checkpoint.shard_format import (
    ShardError,
    ShardHeader,
    Timeline,
    align,
    check_timeline,
)

STORAGE_ALIGN = 64
# Limits a header must respect (anything beyond is a crafted or corrupt shard, `ShardError`):
# nesting of the value tree, dimensions of a tensor, any size or offset, and how many times a
# tensor's elements may outnumber the bytes it views (stride 0: `expand`) - a crafted shape of
# 2**60 elements over 4 bytes would exhaust memory on the first copy.
MAX_TREE_DEPTH = 256
MAX_DIMS = 64
MAX_INT = 1 << 62
MAX_EXPANSION = 1024

# Every dtype a shard may name; anything else in a header is rejected.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        *("float64", "float32", "float16", "bfloat16", "complex128", "complex64"),
        *("int64", "int32", "int16", "int8", "uint8", "bool", "uint16", "uint32", "uint64"),
        *("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"),
        *("float8_e8m0fnu", "complex32"),
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


class UnsupportedValue(TypeError):
    """A value in the state that a checkpoint cannot hold (it would need pickle)."""


def _expansion_ok(logical_bytes: int, span_bytes: int) -> bool:
    """Whether a tensor of `logical_bytes` (elements x size) may view `span_bytes` of storage."""
    return logical_bytes <= max(span_bytes, 1) * MAX_EXPANSION


# -- flattening -------------------------------------------------------------------------------


@dataclass
class StorageRange:
    """The span of one tensor storage that the saved tensors cover, and where it goes in the
    data."""

    source: torch.Tensor  # uint8 view of the span, on the tensor's device
    offset: int  # in the data region
    nbytes: int


@dataclass
class Plan:
    """A state flattened: the header without checksums and the byte ranges to copy."""

    header: ShardHeader
    ranges: list[StorageRange] = field(default_factory=list)
    data_len: int = 0


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte of t's storage that t touches."""
    size = t.element_size()
    if t.numel() == 0:
        start = int(t.storage_offset()) * size
        return start, start
    last = int(t.storage_offset()) + sum(
        (int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride(), strict=True)
    )
    return int(t.storage_offset()) * size, (last + 1) * size


def _check_tensor(t: torch.Tensor) -> tuple[int, int]:
    """t's `_span`, or UnsupportedValue when a checkpoint cannot hold t."""
    if t.layout != torch.strided:
        raise UnsupportedValue(
            f"cannot checkpoint a {t.layout} tensor: convert it to a dense tensor first"
        )
    if t.is_quantized or t.device.type == "meta":
        raise UnsupportedValue(
            f"cannot checkpoint a {'quantized' if t.is_quantized else 'meta'} tensor"
        )
    if str(t.dtype).removeprefix("torch.") not in DTYPES:
        raise UnsupportedValue(f"cannot checkpoint tensors of dtype {t.dtype}")
    if any(s < 0 for s in t.stride()):
        raise UnsupportedValue("cannot checkpoint a tensor with negative strides")
    lo, hi = _span(t)
    if not _expansion_ok(t.numel() * t.element_size(), hi - lo):
        raise UnsupportedValue(
            f"cannot checkpoint a tensor expanded {MAX_EXPANSION}x beyond its storage: "
            "call .contiguous() on it first"
        )
    return lo, hi


# (device, storage pointer, storage bytes): which storage a tensor views.
StorageKey = tuple[str, int, int]
# What `_described` says of a tensor: its storage, the first and last byte it spans, its entry.
Described = tuple[StorageKey, int, int, dict[str, Any]]
# What `_described` said of each tensor it saw, by id, while the tensor lives: a save every step
# describes the same tensors every step. id -> (the tensor's weak reference, what the
# description depends on, the description, and `_source`'s byte view of its span once made).
_DESCRIBED: dict[int, tuple[weakref.ref[torch.Tensor], tuple[Any, ...], Described, list[Any]]] = {}


class Diverted(Exception):
    """`plan_state` met a value of its `divert` type: the caller plans such a state itself."""


def _described(t: torch.Tensor) -> Described:
    """(storage key, first and last byte of the storage it spans, table entry) of tensor `t`,
    checked (`_check_tensor`); the one from before while `t` views the same memory the same
    way (data pointer, dtype, shape, strides, requires_grad)."""
    key = id(t)
    known = _DESCRIBED.get(key)
    if known is not None and known[0]() is t and known[1] == _depends(t):
        return known[2]
    lo, hi = _check_tensor(t)  # UnsupportedValue for what a checkpoint cannot hold
    storage = t.untyped_storage()
    entry: dict[str, Any] = {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "byte": t.storage_offset() * t.element_size(),
        "device": str(t.device),
    }
    if t.requires_grad:
        entry["grad"] = True
    if isinstance(t, torch.nn.Parameter):
        entry["param"] = True
    described = ((str(t.device), storage.data_ptr(), storage.nbytes()), lo, hi, entry)

    def forget(_: weakref.ref[torch.Tensor]) -> None:
        _DESCRIBED.pop(key, None)

    _DESCRIBED[key] = (weakref.ref(t, forget), _depends(t), described, [])
    return described


def _source(example: torch.Tensor, lo: int, nbytes: int) -> torch.Tensor:
    """A uint8 view of bytes [lo, lo + nbytes) of `example`'s storage; the one made before for
    the same span while `example` is described the same (a save every step copies the same
    spans every step, and making a view costs more than the copy of a small tensor)."""
    known = _DESCRIBED.get(id(example))
    made = known[3] if known is not None and known[0]() is example else None
    if made and made[0] == (lo, nbytes):
        view: torch.Tensor = made[1]  # made: [(lo, nbytes), the view]
        return view
    source = torch.empty(0, dtype=torch.uint8, device=example.device)
    source.set_(example.untyped_storage(), lo, (nbytes,), (1,))
    if made is not None:
        made[:] = [(lo, nbytes), source]
    return source


def _depends(t: torch.Tensor) -> tuple[Any, ...]:
    """What `_described` of a checked tensor depends on."""
    return (t.data_ptr(), t.dtype, t.shape, t.stride(), t.requires_grad)


def plan_state(
    state: Any,
    step: int,
    rank: int,
    world_size: int,
    timeline: Timeline | None = None,
    divert: type[Any] | None = None,
) -> Plan:
    """Flatten `state` into a header (tensor table, storage table, value tree, timeline) and
    byte ranges. `divert`: a tensor type this module does not plan (DTensor, reshard.py):
    meeting one raises `Diverted`."""
    tensors: list[dict[str, Any]] = []
    storages: dict[StorageKey, dict[str, Any]] = {}  # -> {"tensors": [...], "lo", "hi"}

    def encode(v: Any) -> Any:
        # The types of nearly every value of a model's and an optimizer's state first, by
        # identity (a save every step walks the state every step); the rest below.
        kind = type(v)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            return {"T": add_tensor(v)}
        if kind is dict:
            return {"d": [[encode(k), encode(x)] for k, x in v.items()]}
        if kind is str or kind is bool or v is None:
            return v
        if kind is int:
            return {"i": str(v)}
        if kind is float:
            return {"f": v.hex()}
        if kind is list or kind is tuple:
            return {"l" if kind is list else "t": [encode(x) for x in v]}
        if isinstance(v, torch.Tensor):
            if divert is not None and isinstance(v, divert):
                raise Diverted(type(v).__name__)
            return {"T": add_tensor(v)}
        if isinstance(v, np.ndarray):
            if v.dtype == object:
                raise UnsupportedValue("cannot checkpoint a numpy array of Python objects")
            return {"N": add_tensor(torch.from_numpy(np.ascontiguousarray(v)))}
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, (int, np.integer)):
            return {"i": str(int(v))}
        if isinstance(v, (float, np.floating)):
            return {"f": float(v).hex()}
        if isinstance(v, complex):
            return {"c": [v.real.hex(), v.imag.hex()]}
        if isinstance(v, (bytes, bytearray)):
            return {"y": base64.b64encode(bytes(v)).decode()}
        if isinstance(v, torch.dtype):
            return {"dt": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"dev": str(v)}
        if isinstance(v, torch.Size):
            return {"sz": list(v)}
        if isinstance(v, dict):
            items = [[encode(k), encode(x)] for k, x in v.items()]
            if isinstance(v, OrderedDict):
                node = {"od": items}
                meta = getattr(v, "_metadata", None)  # nn.Module.state_dict() versions
                if meta is not None:
                    node["meta"] = encode(meta)
                return node
            if type(v) is not dict:
                raise UnsupportedValue(f"cannot checkpoint a {type(v).__name__}: use a dict")
            return {"d": items}
        if type(v) in (list, tuple):
            return {"l" if type(v) is list else "t": [encode(x) for x in v]}
        raise UnsupportedValue(
            f"cannot checkpoint a value of type {type(v).__module__}.{type(v).__qualname__}: "
            f"only tensors, numpy arrays, dicts, lists, tuples and plain values"
        )

    def add_tensor(t: torch.Tensor) -> int:
        key, lo, hi, entry = _described(t)
        group = storages.setdefault(key, {"tensors": [], "lo": lo, "hi": hi, "example": t})
        group["lo"], group["hi"] = min(group["lo"], lo), max(group["hi"], hi)
        group["tensors"].append(len(tensors))
        tensors.append(dict(entry))  # its own: "storage" and "byte" are set below
        return len(tensors) - 1

    tree = encode(state)
    ranges: list[StorageRange] = []
    storage_table: list[tuple[int, int]] = []
    offset = 0
    for group in storages.values():
        lo = group["lo"] // 16 * 16  # keeps every tensor's offset a multiple of its element size
        nbytes = group["hi"] - lo
        ranges.append(StorageRange(_source(group["example"], lo, nbytes), offset, nbytes))
        index = len(storage_table)
        storage_table.append((offset, nbytes))
        for i in group["tensors"]:
            tensors[i]["storage"] = index
            tensors[i]["byte"] -= lo
        offset = align(offset + nbytes, STORAGE_ALIGN)
    header = ShardHeader(
        step=int(step),
        rank=int(rank),
        world_size=int(world_size),
        data_len=offset,
        tree=tree,
        tensors=tuple(tensors),
        storages=tuple(storage_table),
        timeline=timeline,
    )
    return Plan(header, ranges, offset)


def copy_into(plan: Plan, data: torch.Tensor, non_blocking: bool = False) -> None:
    """Copy every storage range of `plan` into `data` (a uint8 tensor of at least plan.data_len)."""
    for r in plan.ranges:
        if r.nbytes:
            data[r.offset : r.offset + r.nbytes].copy_(r.source, non_blocking=non_blocking)


def as_bytes(buffer: mmap.mmap | memoryview | bytearray) -> torch.Tensor:
    """A uint8 tensor sharing the buffer's memory, no copy (the tensor keeps the buffer alive):
    a shared-memory region, or a shard's data as the server side's code returns it."""
    if len(buffer) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)


# -- rebuilding -------------------------------------------------------------------------------


def rebuild(
    header: ShardHeader,
    data: torch.Tensor | memoryview,
    expected_timeline: Timeline | None = None,
) -> Any:
    """The state saved in a shard, its tensors viewing `data` (the data region: a uint8 CPU
    tensor, or a writable buffer such as a tier's `read` returns, viewed without a copy).

    The header's fields were checked when it was read (`ShardHeader.from_json`); its tables are
    validated against the data length here, so a crafted header cannot make a tensor reach
    outside the data. Every malformed header raises `ShardError` (never RecursionError,
    RuntimeError, OverflowError, ...), so a loader falls back to the next copy.
    `expected_timeline`: also refuse a shard of another timeline (`Timeline`).
    """
    if expected_timeline is not None:
        check_timeline(header, expected_timeline)
    if not isinstance(data, torch.Tensor):
        data = as_bytes(data)
    try:
        return _rebuild(header, data)
    except ShardError:
        raise
    except (
        RecursionError,
        RuntimeError,
        OverflowError,
        MemoryError,
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
    ) as e:
        reason = f"{type(e).__name__}: {str(e)[:200]}"
        raise ShardError(f"shard header is malformed ({reason})") from None


def _rebuild(header: ShardHeader, data: torch.Tensor) -> Any:
    data_len = data.numel()
    storages, table, tree = list(header.storages), header.tensors, header.tree
    for off, n in storages:
        if off < 0 or n < 0 or off + n > data_len:
            raise ShardError(
                "shard storage table points outside the data: corrupt or mismatched shard"
            )
    built: list[torch.Tensor | None] = [None] * len(table)

    def tensor(i: Any) -> torch.Tensor:
        if type(i) is not int or not 0 <= i < len(table):
            raise ShardError(f"shard tree names tensor {i!r}, which is not in its table")
        made = built[i]
        if made is None:
            made = built[i] = _make_tensor(table[i], storages, data)
        return made

    def decode(node: Any, depth: int = 0) -> Any:
        if node is None or isinstance(node, (bool, str)):
            return node
        if depth > MAX_TREE_DEPTH:
            raise ShardError(f"shard tree is nested deeper than {MAX_TREE_DEPTH} levels")
        sub = depth + 1
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise ShardError(f"shard tree has an unknown node {str(node)[:80]!r}")
        ((tag, v),) = list(node.items())[:1]
        try:
            if tag == "T":
                return tensor(v)
            if tag == "N":
                return tensor(v).numpy()
            if tag == "i":
                return int(v)
            if tag == "f":
                return float.fromhex(v)
            if tag == "c":
                return complex(float.fromhex(v[0]), float.fromhex(v[1]))
            if tag == "y":
                return base64.b64decode(v)
            if tag == "dt":
                return DTYPES[v]
            if tag == "dev":
                return torch.device(v)
            if tag == "sz":
                return torch.Size(int(x) for x in v)
            if tag == "l":
                return [decode(x, sub) for x in v]
            if tag == "t":
                return tuple(decode(x, sub) for x in v)
            if tag == "d":
                return {decode(k, sub): decode(x, sub) for k, x in v}
            if tag == "od":
                out = OrderedDict((decode(k, sub), decode(x, sub)) for k, x in v)
                if "meta" in node:
                    out._metadata = decode(node["meta"], sub)  # type: ignore[attr-defined]
                return out
        except ShardError:
            raise
        except (TypeError, ValueError, KeyError, OverflowError, RuntimeError, IndexError) as e:
            raise ShardError(f"shard tree node {str(tag)[:40]!r} is malformed: {e}") from None
        raise ShardError(f"shard tree has an unknown node type {tag!r}")

    return decode(tree)


def _make_tensor(
    entry: dict[str, Any], storages: list[tuple[int, int]], data: torch.Tensor
) -> torch.Tensor:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = [int(x) for x in entry["shape"]]
        stride = [int(x) for x in entry["stride"]]
        byte = int(entry["byte"])
        off, nbytes = storages[int(entry["storage"])]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ShardError(f"shard tensor table entry is malformed: {e}") from e
    size = dtype.itemsize
    if (
        len(shape) != len(stride)
        or len(shape) > MAX_DIMS
        or any(not 0 <= n < MAX_INT for n in shape)
        or any(not 0 <= s < MAX_INT for s in stride)
        or not 0 <= byte < MAX_INT
    ):
        raise ShardError("shard tensor has a bad shape, stride or offset")
    numel = math.prod(shape)
    end = byte + (
        (sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * size if numel else 0
    )
    if end > nbytes or (off + byte) % size:
        raise ShardError("shard tensor reaches outside its storage: corrupt or mismatched shard")
    if numel * size >= MAX_INT or not _expansion_ok(numel * size, end - byte):
        raise ShardError(
            f"shard tensor of shape {shape[:8]} views only {end - byte} bytes (a zero stride "
            f"expanding it over {MAX_EXPANSION}x): corrupt or crafted shard"
        )
    t = torch.empty(0, dtype=dtype)
    t.set_(data.untyped_storage(), (data.storage_offset() + off + byte) // size, shape, stride)
    if entry.get("param"):
        return torch.nn.Parameter(t, requires_grad=bool(entry.get("grad")))
    if entry.get("grad") and (t.is_floating_point() or t.is_complex()):
        t.requires_grad_(True)
    return t
