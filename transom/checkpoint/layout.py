"""A shard back into a rank's state: the header's tables checked, its tensors viewing the data.

The worker's side of the shard format (shard_format.py has its bytes: prefix, JSON header,
checksums; flatten.py makes a header and the byte ranges of a state). `rebuild` turns a header
and a data region back into the state, its tensors viewing the data; the limits and dtypes a
header may name are here, for both sides.

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
from collections import OrderedDict
from typing import Any

import torch

from transom.checkpoint.shard_format import (
    ShardError,
    ShardHeader,
    Timeline,
    check_timeline,
)

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


def expansion_ok(logical_bytes: int, span_bytes: int) -> bool:
    """Whether a tensor of `logical_bytes` (elements x size) may view `span_bytes` of storage."""
    return logical_bytes <= max(span_bytes, 1) * MAX_EXPANSION


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
    if numel * size >= MAX_INT or not expansion_ok(numel * size, end - byte):
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
