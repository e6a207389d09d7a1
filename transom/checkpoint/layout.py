"""The shard format: how one rank's checkpoint state becomes a header plus raw bytes, and back.

A shard is what one rank saved at one step. Its bytes are

    prefix  MAGIC (8 bytes), format version (u32), header length (u32), header xxh3-64 (u64),
            data length (u64)                                                      32 bytes
    header  UTF-8 JSON: step, rank, world size, the tensor table, the storage table, the tree of
            non-tensor values, and one xxh3-64 checksum per DATA_CHUNK of the data
    padding to DATA_ALIGN
    data    the bytes of every tensor storage range, each range aligned to STORAGE_ALIGN

In shared memory the data region is held alone and the header next to it (the server keeps it);
on disk and on the wire the three parts follow each other.

Tensors are saved by the byte range of their storage that they span, so non-contiguous tensors
keep their strides and tensors that are views of one storage come back as views of one storage.
Everything that is not a tensor is encoded as a JSON tree of known node types (containers,
numbers, strings, bytes, dtypes, ...). This module must never unpickle, eval or import anything
named by a shard: a shard is data, and a crafted one can at worst be rejected with `ShardError`.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

MAGIC = b"TRNSHRD\x00"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<8sIIQQ")  # magic, version, header length, header xxh3-64, data length
DATA_ALIGN = 4096
STORAGE_ALIGN = 64
# Checksums are per chunk of data, so verification runs on several threads and names the bad chunk.
DATA_CHUNK = 64 << 20
VERIFY_THREADS = 4
MAX_HEADER_BYTES = 256 << 20
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


class ShardError(ValueError):
    """A shard that is truncated, corrupt, of another format, or not the one asked for."""


class UnsupportedValue(TypeError):
    """A value in the state that a checkpoint cannot hold (it would need pickle)."""


def align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


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

    header: dict
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


def _check_tensor(t: torch.Tensor) -> None:
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


def timeline(job: str, generation: int, world_size: int) -> dict:
    """The timeline a shard belongs to: its job, the generation that saved it, its world size.
    Shards of one step are one checkpoint only when their timelines are equal."""
    return {"job": str(job), "generation": int(generation), "world_size": int(world_size)}


def plan_state(
    state: Any, step: int, rank: int, world_size: int, timeline: dict | None = None
) -> Plan:
    """Flatten `state` into a header (tensor table, storage table, value tree, timeline) and
    byte ranges."""
    tensors: list[dict] = []
    storages: dict[tuple, dict] = {}  # (device, storage pointer) -> {"tensors": [...], "lo", "hi"}

    def encode(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
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
        _check_tensor(t)
        key = (str(t.device), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        lo, hi = _span(t)
        group = storages.setdefault(key, {"tensors": [], "lo": lo, "hi": hi, "example": t})
        group["lo"], group["hi"] = min(group["lo"], lo), max(group["hi"], hi)
        entry = {
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
        group["tensors"].append(len(tensors))
        tensors.append(entry)
        return len(tensors) - 1

    tree = encode(state)
    plan = Plan(header={})
    storage_table: list[dict[str, int]] = []
    offset = 0
    for group in storages.values():
        lo = group["lo"] // 16 * 16  # keeps every tensor's offset a multiple of its element size
        nbytes = group["hi"] - lo
        example = group["example"]
        source = torch.empty(0, dtype=torch.uint8, device=example.device)
        source.set_(example.untyped_storage(), lo, (nbytes,), (1,))
        plan.ranges.append(StorageRange(source, offset, nbytes))
        index = len(storage_table)
        storage_table.append({"offset": offset, "nbytes": nbytes})
        for i in group["tensors"]:
            tensors[i]["storage"] = index
            tensors[i]["byte"] -= lo
        offset = align(offset + nbytes, STORAGE_ALIGN)
    plan.data_len = offset
    plan.header = {
        "format": FORMAT_VERSION,
        "step": int(step),
        "rank": int(rank),
        "world_size": int(world_size),
        "tree": tree,
        "tensors": tensors,
        "storages": storage_table,
        "data_len": offset,
    }
    if timeline is not None:
        plan.header["timeline"] = timeline
    return plan


def copy_into(plan: Plan, data: torch.Tensor, non_blocking: bool = False) -> None:
    """Copy every storage range of `plan` into `data` (a uint8 tensor of at least plan.data_len)."""
    for r in plan.ranges:
        if r.nbytes:
            data[r.offset : r.offset + r.nbytes].copy_(r.source, non_blocking=non_blocking)


# -- checksums --------------------------------------------------------------------------------


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(i, min(i + DATA_CHUNK, n)) for i in range(0, n, DATA_CHUNK)]


def checksum_data(data: memoryview) -> list[str]:
    """xxh3-64 of every DATA_CHUNK of `data`, as hex (xxhash releases the GIL: threads help)."""
    with ThreadPoolExecutor(VERIFY_THREADS) as pool:
        return list(
            pool.map(lambda c: xxhash.xxh3_64_hexdigest(data[c[0] : c[1]]), _chunks(len(data)))
        )


def verify_data(header: dict, data: memoryview) -> None:
    expected = header.get("chunks")
    if not isinstance(expected, list) or len(expected) != len(_chunks(len(data))):
        raise ShardError("shard header has no valid chunk checksums")
    actual = checksum_data(data)
    bad = [i for i, (a, b) in enumerate(zip(actual, expected, strict=True)) if a != b]
    if bad:
        raise ShardError(
            f"checksum mismatch in data chunk(s) {bad[:5]} of step {header.get('step')} "
            f"rank {header.get('rank')}: the copy is corrupt"
        )


# -- header bytes -----------------------------------------------------------------------------


def encode_header(header: dict) -> bytes:
    """Prefix + JSON header + padding to DATA_ALIGN: the bytes in front of the data."""
    body = json.dumps(header, separators=(",", ":")).encode()
    prefix = PREFIX.pack(
        MAGIC, FORMAT_VERSION, len(body), xxhash.xxh3_64_intdigest(body), header["data_len"]
    )
    out = prefix + body
    return out + b"\0" * (align(len(out), DATA_ALIGN) - len(out))


def decode_prefix(prefix: bytes) -> tuple[int, int, int]:
    """(header length, header checksum, data length) from the first PREFIX.size bytes."""
    if len(prefix) < PREFIX.size:
        raise ShardError(f"shard is truncated: {len(prefix)} bytes, not even a header")
    magic, version, header_len, header_sum, data_len = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise ShardError("not a transom checkpoint shard (bad magic bytes)")
    if version != FORMAT_VERSION:
        raise ShardError(
            f"shard format version {version} is not supported (this build reads {FORMAT_VERSION})"
        )
    if header_len > MAX_HEADER_BYTES:
        raise ShardError(f"shard header of {header_len} bytes is implausible: corrupt shard")
    return header_len, header_sum, data_len


def decode_header(prefix_and_body: bytes) -> tuple[dict, int]:
    """The header dict and the data offset, from bytes starting at the prefix."""
    header_len, header_sum, data_len = decode_prefix(prefix_and_body[: PREFIX.size])
    body = prefix_and_body[PREFIX.size : PREFIX.size + header_len]
    if len(body) != header_len:
        raise ShardError("shard is truncated inside its header")
    if xxhash.xxh3_64_intdigest(body) != header_sum:
        raise ShardError("shard header checksum mismatch: the header is corrupt")
    try:
        header = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise ShardError(f"shard header is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(header, dict) or header.get("data_len") != data_len:
        raise ShardError("shard header does not match its prefix")
    return header, align(PREFIX.size + header_len, DATA_ALIGN)


def header_span(header_len: int) -> int:
    return align(PREFIX.size + header_len, DATA_ALIGN)


# -- rebuilding -------------------------------------------------------------------------------


def check_identity(header: dict, step: int | None, rank: int | None) -> None:
    if step is not None and header.get("step") != step:
        raise ShardError(f"shard holds step {header.get('step')}, not step {step}")
    if rank is not None and header.get("rank") != rank:
        raise ShardError(f"shard holds rank {header.get('rank')}, not rank {rank}")


def check_timeline(header: dict, expected: dict) -> None:
    """ShardError unless the shard was saved under the timeline `expected` (see `timeline`)."""
    found = header.get("timeline")
    if found != expected:
        raise ShardError(
            f"shard of step {header.get('step')} rank {header.get('rank')} belongs to timeline "
            f"{found}, not {expected}: it is not part of this checkpoint"
        )


def rebuild(header: dict, data: torch.Tensor, expected_timeline: dict | None = None) -> Any:
    """The state saved in a shard, its tensors viewing `data` (a uint8 CPU tensor of the data
    region).

    The header's tables are validated against the data length first, so a crafted header
    cannot make a tensor reach outside the data. Every malformed header raises `ShardError`
    (never RecursionError, RuntimeError, OverflowError, ...), so a loader falls back to the next
    copy. `expected_timeline`: also refuse a shard of another timeline (see `timeline`).
    """
    if not isinstance(header, dict):
        raise ShardError("shard header is not an object")
    if expected_timeline is not None:
        check_timeline(header, expected_timeline)
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


def _rebuild(header: dict, data: torch.Tensor) -> Any:
    if header.get("format") != FORMAT_VERSION:
        raise ShardError(f"shard format {header.get('format')} is not supported")
    data_len = data.numel()
    try:
        storages = [(int(s["offset"]), int(s["nbytes"])) for s in header["storages"]]
        table = header["tensors"]
        tree = header["tree"]
    except (KeyError, TypeError, ValueError) as e:
        raise ShardError(f"shard header lacks its tables: {e}") from e
    if not isinstance(table, list):
        raise ShardError("shard tensor table is not a list")
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


def _make_tensor(entry: dict, storages: list[tuple[int, int]], data: torch.Tensor) -> torch.Tensor:
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
