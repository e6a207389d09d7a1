"""A rank's state flattened for a save: its header (tensor table, storage table, value tree)
and the byte ranges of its tensors' storages to copy into the data region.

`plan_state` walks a state into a JSON tree of known node types and a list of its tensors;
`copy_into` copies the ranges into the data region (each aligned to STORAGE_ALIGN); layout.py
rebuilds a state from a shard. A save every step plans the same tensors every step, so the
tables are kept while a state's tensors view the same memory the same way (`_Tables`): such a
save walks the values and compares each tensor's view, nothing more.

Only workers import this module (it needs torch). It never keeps a state's tensors alive (only
weak references, and views of a storage while the tensor that made them lives) and never
writes to them.
"""

from __future__ import annotations

import base64
import itertools
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from transom.checkpoint.layout import DTYPES, MAX_EXPANSION, UnsupportedValue, expansion_ok
from transom.checkpoint.shard_format import ShardHeader, Timeline, align

STORAGE_ALIGN = 64


@dataclass
class Plan:
    """A state flattened: the header without checksums and the byte ranges to copy, as what
    each is copied from and where it goes, in two lists: a save every step copies them in one
    call, nothing made per range."""

    header: ShardHeader
    # Each range's source, on its tensor's device: the tensor itself when it spans the range's
    # bytes alone (`_spans_alone`), else a uint8 view of them (`_source`).
    sources: list[torch.Tensor] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (offset in the data, bytes)
    data_len: int = 0
    # The number of its tensor and storage tables while they are kept for the next plans (the
    # server is sent them once: header_tables.py); None when they are not.
    tables: int | None = None
    cuda: frozenset[torch.device] = frozenset()  # the GPUs it copies from

    def cuda_devices(self) -> set[torch.device]:
        """The GPUs it copies from (none: a CPU save)."""
        return set(self.cuda)


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
    if not expansion_ok(t.numel() * t.element_size(), hi - lo):
        raise UnsupportedValue(
            f"cannot checkpoint a tensor expanded {MAX_EXPANSION}x beyond its storage: "
            "call .contiguous() on it first"
        )
    return lo, hi


# (device, storage pointer, storage bytes): which storage a tensor views.
StorageKey = tuple[str, int, int]
# What `_described` says of a tensor: its storage, the first and last byte it spans, its entry.
Described = tuple[StorageKey, int, int, dict[str, Any]]
# The byte views `_source` made, by the id of the tensor they were made from, while it lives:
# (its weak reference, its data pointer then, (first byte, bytes), the view).
_VIEWS: dict[int, tuple[weakref.ref[torch.Tensor], int, tuple[int, int], torch.Tensor]] = {}


class Diverted(Exception):
    """`plan_state` met a value of its `divert` type: the caller plans such a state itself."""


def _described(t: torch.Tensor) -> Described:
    """(storage key, first and last byte of the storage it spans, table entry) of tensor `t`,
    checked (`_check_tensor`: UnsupportedValue for what a checkpoint cannot hold)."""
    lo, hi = _check_tensor(t)
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
    return (str(t.device), storage.data_ptr(), storage.nbytes()), lo, hi, entry


def _spans_alone(example: torch.Tensor, lo: int, nbytes: int) -> bool:
    """`example` is a plain contiguous tensor spanning bytes [lo, lo + nbytes) of its storage
    exactly (a model's or an optimizer's tensors): they are copied from it as it is, no view
    made. Not a subclass, a conjugate or a negative view: copying one would not copy its
    storage's bytes as they are, which the other tensors of the storage may view."""
    size = example.element_size()
    return (
        type(example) in (torch.Tensor, torch.nn.Parameter)
        and example.storage_offset() * size == lo
        and example.numel() * size == nbytes
        and example.is_contiguous()
        and not example.is_conj()
        and not example.is_neg()
    )


def _source(example: torch.Tensor, lo: int, nbytes: int) -> torch.Tensor:
    """A uint8 view of bytes [lo, lo + nbytes) of `example`'s storage; the one made before for
    the same span while `example` lives and views the same memory (a save every step copies
    the same spans every step, and making a view costs more than the copy of a small tensor)."""
    key, pointer = id(example), example.data_ptr()
    known = _VIEWS.get(key)
    if known is not None and known[0]() is example and known[1:3] == (pointer, (lo, nbytes)):
        return known[3]
    source = torch.empty(0, dtype=torch.uint8, device=example.device)
    source.set_(example.untyped_storage(), lo, (nbytes,), (1,))

    def forget(_: weakref.ref[torch.Tensor]) -> None:
        _VIEWS.pop(key, None)

    _VIEWS[key] = (weakref.ref(example, forget), pointer, (lo, nbytes), source)
    return source


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Everything a tensor's table entry and byte span follow from: two tensors with one key
    view the same bytes the same way (while a storage lives, no other owns its addresses)."""
    return (
        t.data_ptr(),
        t.storage_offset(),
        t.dtype,
        t.shape,
        t.stride(),
        t.layout,
        t.device,
        t.requires_grad,
        type(t),
    )


@dataclass
class _Tables:
    """The tensor and storage tables of a state's tensors, and its storage ranges as (the index
    of a tensor in the storage, first byte, bytes, offset in the data, whether that tensor
    `_spans_alone` the bytes: then it is what they are copied from): what `plan_state` reuses
    while a state's tensors have the same `_view_key`s (a save every step plans the same
    tensors every step; a model's `state_dict()` gives new tensor objects each time)."""

    keys: list[tuple[Any, ...]]
    tensors: tuple[dict[str, Any], ...]
    storages: tuple[tuple[int, int], ...]  # (offset, nbytes) in the data
    ranges: list[tuple[int, int, int, int, bool]]  # of the storages with bytes to copy
    data_len: int
    number: int | None = None  # kept for the next plans: `Plan.tables`
    cuda: frozenset[torch.device] = frozenset()  # the GPUs the ranges are on
    spans: list[tuple[int, int]] = field(init=False)  # (offset in the data, bytes) of each range

    def __post_init__(self) -> None:
        self.spans = [(offset, nbytes) for _, _, nbytes, offset, _ in self.ranges]


_NUMBERS = itertools.count(1)
# The tables planned lately, newest first (a process may save a few different states in turn).
_TABLES: list[_Tables] = []
KEPT_TABLES = 4


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
    leaves: list[torch.Tensor] = []

    def encode(v: Any) -> Any:
        # The types of nearly every value of a model's and an optimizer's state first, by
        # identity (a save every step walks the state every step); the rest below.
        kind = type(v)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            leaves.append(v)
            return {"T": len(leaves) - 1}
        if kind is dict or kind is OrderedDict:
            items = []
            for k, x in v.items():  # str and int keys, tensor values here: no call for them
                key = k if type(k) is str else {"i": str(k)} if type(k) is int else encode(k)
                inner = type(x)
                if inner is torch.Tensor or inner is torch.nn.Parameter:
                    leaves.append(x)
                    items.append([key, {"T": len(leaves) - 1}])
                else:
                    items.append([key, encode(x)])
            if kind is dict:
                return {"d": items}
            node = {"od": items}
            meta = getattr(v, "_metadata", None)  # nn.Module.state_dict() versions
            if meta is not None:
                node["meta"] = encode(meta)
            return node
        if kind is str or kind is bool or v is None:
            return v
        if kind is int:
            return {"i": str(v)}
        if kind is float:
            return {"f": v.hex()}
        if kind is list or kind is tuple:  # an optimizer's parameter numbers: ints, inline
            return {
                "l" if kind is list else "t": [
                    {"i": str(x)} if type(x) is int else encode(x) for x in v
                ]
            }
        if isinstance(v, torch.Tensor):
            if divert is not None and isinstance(v, divert):
                raise Diverted(type(v).__name__)
            leaves.append(v)
            return {"T": len(leaves) - 1}
        if isinstance(v, np.ndarray):
            if v.dtype == object:
                raise UnsupportedValue("cannot checkpoint a numpy array of Python objects")
            leaves.append(torch.from_numpy(np.ascontiguousarray(v)))
            return {"N": len(leaves) - 1}
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

    tree = encode(state)
    tables = _tables(leaves)
    header = ShardHeader(
        step=int(step),
        rank=int(rank),
        world_size=int(world_size),
        data_len=tables.data_len,
        tree=tree,
        tensors=tables.tensors,  # shared with the plans of the same tables: never changed
        storages=tables.storages,
        timeline=timeline,
    )
    sources = [
        leaves[i] if alone else _source(leaves[i], lo, nbytes)
        for i, lo, nbytes, _, alone in tables.ranges
    ]
    return Plan(header, sources, tables.spans, tables.data_len, tables.number, tables.cuda)


def _tables(leaves: list[torch.Tensor]) -> _Tables:
    """The tables of `leaves` (the state's tensors in the order its tree numbers them): those
    planned lately for tensors of the same keys, else planned now (`_plan_tables`)."""
    try:
        keys = [_view_key(t) for t in leaves]
    except (RuntimeError, NotImplementedError):  # no data pointer (sparse, ...): checked below
        return _plan_tables(leaves, None)
    for i, known in enumerate(_TABLES):
        if known.keys == keys:
            if i:
                _TABLES.insert(0, _TABLES.pop(i))
            return known
    return _plan_tables(leaves, keys)


def _plan_tables(leaves: list[torch.Tensor], keys: list[tuple[Any, ...]] | None) -> _Tables:
    """Check and describe each tensor (`_described`: UnsupportedValue for what a checkpoint
    cannot hold), group them by storage and lay the storages' spans out in the data; kept for
    the next plan when the tensors have `keys`."""
    tensors: list[dict[str, Any]] = []
    storages: dict[StorageKey, dict[str, Any]] = {}  # -> {"tensors": [...], "lo", "hi", "first"}
    for index, t in enumerate(leaves):
        key, lo, hi, entry = _described(t)
        group = storages.setdefault(key, {"tensors": [], "lo": lo, "hi": hi, "first": index})
        group["lo"], group["hi"] = min(group["lo"], lo), max(group["hi"], hi)
        group["tensors"].append(index)
        tensors.append(dict(entry))  # its own: "storage" and "byte" are set below
    storage_table: list[tuple[int, int]] = []
    ranges: list[tuple[int, int, int, int, bool]] = []
    offset = 0
    for group in storages.values():
        lo = group["lo"] // 16 * 16  # keeps every tensor's offset a multiple of its element size
        nbytes = group["hi"] - lo
        if nbytes:
            first = group["first"]
            ranges.append((first, lo, nbytes, offset, _spans_alone(leaves[first], lo, nbytes)))
        index = len(storage_table)
        storage_table.append((offset, nbytes))
        for i in group["tensors"]:
            tensors[i]["storage"] = index
            tensors[i]["byte"] -= lo
        offset = align(offset + nbytes, STORAGE_ALIGN)
    number = next(_NUMBERS) if keys is not None else None
    cuda = frozenset(leaves[r[0]].device for r in ranges if leaves[r[0]].is_cuda)
    tables = _Tables(keys or [], tuple(tensors), tuple(storage_table), ranges, offset, number, cuda)
    if keys is not None:
        _TABLES.insert(0, tables)
        del _TABLES[KEPT_TABLES:]
    return tables


# The views of a data region that `copy_into` made for kept tables, by the id of the region's
# tensor, while it lives: (its weak reference, its data pointer then, the tables' number, the
# views). A save every step rotates through a few regions with the same tables.
_DESTINATIONS: dict[int, tuple[weakref.ref[torch.Tensor], int, int, list[torch.Tensor]]] = {}


def copy_into(plan: Plan, data: torch.Tensor, non_blocking: bool = False) -> None:
    """Copy every storage range of `plan` into `data` (a uint8 tensor of at least plan.data_len).
    From CPU tensors in one call (`torch._foreach_copy_`: no Python per tensor), into the views
    of `data` made for the plan's tables before when they are kept."""
    with torch.no_grad():  # a parameter's bytes are copied, not recorded for its gradient
        if plan.cuda:
            for source, (offset, nbytes) in zip(plan.sources, plan.spans, strict=True):
                _into(data, source, offset, nbytes).copy_(source, non_blocking=non_blocking)
        elif plan.sources:
            torch._foreach_copy_(_destinations(plan, data), plan.sources)


def _into(data: torch.Tensor, source: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The view of `data` that `source` is copied into: bytes [offset, offset + nbytes), as the
    source's dtype and shape (each range starts at a multiple of STORAGE_ALIGN: any dtype can
    view it)."""
    return data[offset : offset + nbytes].view(source.dtype).view(source.shape)


def _destinations(plan: Plan, data: torch.Tensor) -> list[torch.Tensor]:
    """The views of `data` that `plan`'s sources are copied into: those made before for the
    same tables and the same region, else made now (and kept while `data` lives, when the
    tables are)."""
    key, pointer = id(data), data.data_ptr()
    known = _DESTINATIONS.get(key)
    if known is not None and known[0]() is data and known[1:3] == (pointer, plan.tables):
        return known[3]
    views = [
        _into(data, source, offset, nbytes)
        for source, (offset, nbytes) in zip(plan.sources, plan.spans, strict=True)
    ]
    if plan.tables is not None:

        def forget(_: weakref.ref[torch.Tensor]) -> None:
            _DESTINATIONS.pop(key, None)

        _DESTINATIONS[key] = (weakref.ref(data, forget), pointer, plan.tables, views)
    return views
