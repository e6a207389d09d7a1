"""The shard format's bytes: prefix, JSON header, checksums. What a checkpoint server needs of it.

A shard is what one rank saved at one step. Its bytes are

    prefix  MAGIC (8 bytes), format version (u32), header length (u32), header xxh3-64 (u64),
            data length (u64)                                                      32 bytes
    header  UTF-8 JSON: step, rank, world size, timeline, the tensor table, the storage table,
            the tree of non-tensor values, and one xxh3-64 checksum per DATA_CHUNK of the data
    padding to DATA_ALIGN
    data    the bytes of every tensor storage range (layout.py decides where each goes)

In shared memory the data region is held alone and the header next to it (the server keeps it);
on disk and on the wire the three parts follow each other.

This module encodes and decodes the prefix and header (the header's record, and its checks of
every field, are shard_header.py's `ShardHeader`), checksums and verifies the data, and checks
that a header is the shard asked for (step, rank, timeline). The checkpoint server moves
shards with it alone; what the header's tables mean (tensors) is layout.py's, on the worker's
side. This module must never import torch or numpy (the server starts without them), and never
unpickle, eval or import anything named by a shard: a crafted one can at worst be rejected with
`ShardError`.
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor

import xxhash

from transom.checkpoint.protocol import encode_json

# The header's record is shard_header's; readers import it (and ShardError) from here too.
from transom.checkpoint.shard_header import DATA_CHUNK as DATA_CHUNK
from transom.checkpoint.shard_header import FORMAT_VERSION as FORMAT_VERSION
from transom.checkpoint.shard_header import ShardError as ShardError
from transom.checkpoint.shard_header import ShardHeader as ShardHeader
from transom.checkpoint.shard_header import Timeline as Timeline

MAGIC = b"TRNSHRD\x00"
PREFIX = struct.Struct("<8sIIQQ")  # magic, version, header length, header xxh3-64, data length
DATA_ALIGN = 4096
VERIFY_THREADS = 4
MAX_HEADER_BYTES = 256 << 20


def align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# -- checksums --------------------------------------------------------------------------------


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(i, min(i + DATA_CHUNK, n)) for i in range(0, n, DATA_CHUNK)]


def checksum_data(data: memoryview) -> list[str]:
    """xxh3-64 of every DATA_CHUNK of `data`, as hex (xxhash releases the GIL: threads help a
    shard of several chunks; one of a single chunk is hashed in this thread, as starting the
    pool would cost ten times the hashing)."""
    chunks = _chunks(len(data))

    def digest(chunk: tuple[int, int]) -> str:
        return xxhash.xxh3_64_hexdigest(data[chunk[0] : chunk[1]])

    if len(chunks) <= 1:
        return [digest(c) for c in chunks]
    with ThreadPoolExecutor(min(VERIFY_THREADS, len(chunks))) as pool:
        return list(pool.map(digest, chunks))


def verify_data(header: ShardHeader, data: memoryview) -> None:
    expected = header.chunks
    if len(data) != header.data_len or len(expected) != len(_chunks(len(data))):
        raise ShardError("shard header has no valid chunk checksums for its data")
    actual = checksum_data(data)
    bad = [i for i, (a, b) in enumerate(zip(actual, expected, strict=True)) if a != b]
    if bad:
        raise ShardError(
            f"checksum mismatch in data chunk(s) {bad[:5]} of step {header.step} "
            f"rank {header.rank}: the copy is corrupt"
        )


# -- header bytes -----------------------------------------------------------------------------


def encode_header(header: ShardHeader) -> bytes:
    """Prefix + JSON header + padding to DATA_ALIGN: the bytes in front of the data."""
    body = encode_json(header.to_json())
    prefix = PREFIX.pack(
        MAGIC, FORMAT_VERSION, len(body), xxhash.xxh3_64_intdigest(body), header.data_len
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


def decode_header(prefix_and_body: bytes) -> tuple[ShardHeader, int]:
    """The header and the data offset, from bytes starting at the prefix; ShardError for
    anything malformed (`ShardHeader.from_json` checks the header's every field)."""
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
    decoded = ShardHeader.from_json(header)
    if decoded.data_len != data_len:
        raise ShardError("shard header does not match its prefix")
    return decoded, align(PREFIX.size + header_len, DATA_ALIGN)


def header_span(header_len: int) -> int:
    return align(PREFIX.size + header_len, DATA_ALIGN)


def received_header_bytes(prefix_and_body: bytes) -> bytes:
    """The bytes in front of the data of a header `decode_header` accepted, as this node keeps
    them: prefix and body as received (checksummed), the padding zeroed whatever the sender put
    there. What `encode_header` of the decoded header gives, without encoding it again."""
    header_len = decode_prefix(prefix_and_body)[0]
    end = PREFIX.size + header_len
    return prefix_and_body[:end] + bytes(header_span(header_len) - end)


# -- identity ---------------------------------------------------------------------------------


def check_identity(header: ShardHeader, step: int | None, rank: int | None) -> None:
    if step is not None and header.step != step:
        raise ShardError(f"shard holds step {header.step}, not step {step}")
    if rank is not None and header.rank != rank:
        raise ShardError(f"shard holds rank {header.rank}, not rank {rank}")


def check_timeline(header: ShardHeader, expected: Timeline | None) -> None:
    """ShardError unless the shard was saved under the timeline `expected` (`Timeline`)."""
    if header.timeline != expected:
        raise ShardError(
            f"shard of step {header.step} rank {header.rank} belongs to timeline "
            f"{header.timeline}, not {expected}: it is not part of this checkpoint"
        )
