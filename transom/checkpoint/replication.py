"""Shard transfer between nodes over TCP: push a replica to a peer's server, fetch one back.

A connection starts with the mutual HMAC challenge of protocol.py (the job's checkpoint secret,
within AUTH_TIMEOUT_S), then carries one request, or, after puts the server accepted, the next
put (`Pusher` keeps one connection per peer open between the saves of every step):
    {"op": "put", "step", "rank", "header_len", "data_len", "origin"} + header bytes + data bytes
        -> {"ok": true} once the receiver holds the shard in memory with its checksums verified
    {"op": "get", "step", "rank"} -> {"ok": true, "header_len", "data_len"} + header + data
    {"op": "list", "rank"} -> {"ok": true, "held": [[step, world_size], ...]} the rank's shards
        the receiver holds in memory (at most MAX_LISTED; `list_held` checks every entry)
`parse_request` is the one reader of a request: it names the fields, their types and bounds
(a shard's data at most MAX_SHARD_BYTES, its header at most shard_format's MAX_HEADER_BYTES). Both
sides read the shard header's prefix first and check it against the lengths the message named
before reading (or allocating) anything more. Messages must arrive within FRAME_TIMEOUT_S; shard
bytes within TRANSFER_TIMEOUT_S plus their size at MIN_TRANSFER_BYTES_PER_S.

Data leaves a region with sendfile (no copy through Python) and lands with recv_into straight in
the destination memory (`fetch_into`: a region of the fetching server's own, for prefetch.py).
The placement rule (`ring_peer`) puts a node's replicas on the next member of the plan's ring, so
losing one node never loses both copies of a shard. This module moves bytes; it never decides
what a server keeps.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transom.checkpoint import shard_format
from transom.checkpoint.protocol import (
    AUTH_TIMEOUT_S,
    FRAME_TIMEOUT_S,
    MAX_SHARD_BYTES,
    ProtocolError,
    authenticate,
    deadline_in,
    field_int,
    recv_exact,
    recv_into,
    recv_msg,
    send_all,
    send_at_once,
    send_msg,
)
from transom.checkpoint.shard_format import ShardHeader
from transom.checkpoint.shm import Region, anonymous_buffer
from transom.common.names import check_id

CONNECT_TIMEOUT_S = 5.0
# A peer's server waits this long for the next request on a connection that served a put; a
# pusher reuses a connection idle for less than REUSE_S, well inside that.
KEEP_ALIVE_S = 30.0
REUSE_S = KEEP_ALIVE_S / 2
# Shard bytes may stall this long at most; a whole transfer may take this long plus its size at
# MIN_TRANSFER_BYTES_PER_S.
TRANSFER_TIMEOUT_S = 120.0
MIN_TRANSFER_BYTES_PER_S = 16 << 20
SOCKET_BUFFER = 4 << 20
# A peer's request or reply is a small JSON object.
MAX_PEER_MESSAGE = 64 << 10
# A refused put's sender is still sending: this much of it is read and dropped (for at most
# DRAIN_TIMEOUT_S), so the sender reads the reply instead of a reset connection.
DRAIN_MAX_BYTES = 64 << 20
DRAIN_TIMEOUT_S = 2.0
MIN_HEADER_SPAN = shard_format.header_span(0)
MAX_HEADER_SPAN = shard_format.header_span(shard_format.MAX_HEADER_BYTES)


class ReplicationError(ConnectionError):
    """A peer could not be reached, refused the shard, or sent a bad one."""


@dataclass(frozen=True)
class PutRequest:
    step: int
    rank: int
    header_len: int  # the shard's prefix, JSON header and padding: shard_format.header_span
    data_len: int
    origin: str  # the node whose shard this is a replica of


@dataclass(frozen=True)
class GetRequest:
    step: int
    rank: int


@dataclass(frozen=True)
class ListRequest:
    rank: int


# A "list" reply names at most this many shards (a server keeps a few steps per rank).
MAX_LISTED = 256


def parse_request(msg: dict[str, Any]) -> PutRequest | GetRequest | ListRequest:
    """The request in a peer's message; ValueError naming what is wrong with it."""
    op = msg.get("op")
    if op == "put":
        return PutRequest(
            step=field_int(msg, "step"),
            rank=field_int(msg, "rank"),
            header_len=field_int(msg, "header_len", MIN_HEADER_SPAN, MAX_HEADER_SPAN),
            data_len=field_int(msg, "data_len", 0, MAX_SHARD_BYTES),
            origin=check_id("origin", msg.get("origin", "")),
        )
    if op == "get":
        return GetRequest(step=field_int(msg, "step"), rank=field_int(msg, "rank"))
    if op == "list":
        return ListRequest(rank=field_int(msg, "rank"))
    raise ValueError(f"unknown request {str(op)[:40]!r}: put, get or list")


def transfer_deadline(nbytes: int) -> float:
    deadline = deadline_in(TRANSFER_TIMEOUT_S + nbytes / MIN_TRANSFER_BYTES_PER_S)
    assert deadline is not None
    return deadline


def ring_peer(members: list[str], node: str) -> str | None:
    """The node after `node` in the ring of `members` (None when alone or not a member)."""
    if node not in members or len(members) < 2:
        return None
    return members[(members.index(node) + 1) % len(members)]


def connect(addr: str, secret: bytes) -> socket.socket:
    host, _, port = addr.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    except (OSError, ValueError) as e:
        raise ReplicationError(f"cannot reach checkpoint server at {addr}: {e}") from e
    try:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        send_at_once(sock)
        authenticate(sock, secret, initiator=True, deadline=deadline_in(AUTH_TIMEOUT_S))
    except (ProtocolError, OSError) as e:
        sock.close()
        raise ReplicationError(f"checkpoint server at {addr}: {e}") from e
    return sock


def send_region(sock: socket.socket, region_path: Path, nbytes: int) -> None:
    """The first `nbytes` of a region file, kernel to kernel (stalls: TRANSFER_TIMEOUT_S)."""
    if nbytes == 0:
        return
    sock.settimeout(TRANSFER_TIMEOUT_S)
    with open(region_path, "rb") as f:
        sock.sendfile(f, 0, nbytes)


def recv_shard_header(
    sock: socket.socket, header_len: int, data_len: int
) -> tuple[ShardHeader, bytes]:
    """The shard header that follows a message naming `header_len` and `data_len`, and its
    bytes (`shard_format.received_header_bytes`): its prefix is read and checked against them
    before the rest is read. ShardError when they differ."""
    deadline = transfer_deadline(header_len)
    prefix = recv_exact(sock, shard_format.PREFIX.size, deadline)
    body_len, _, prefix_data_len = shard_format.decode_prefix(prefix)
    span = shard_format.header_span(body_len)
    if span != header_len or prefix_data_len != data_len:
        raise shard_format.ShardError(
            f"shard header ({span} bytes, data {prefix_data_len}) does not match the request "
            f"({header_len} bytes, data {data_len})"
        )
    received = prefix + recv_exact(sock, header_len - shard_format.PREFIX.size, deadline)
    header, _ = shard_format.decode_header(received)
    return header, shard_format.received_header_bytes(received)


def push(
    addr: str,
    secret: bytes,
    header: ShardHeader,
    header_bytes: bytes,
    region_path: Path,
    origin: str,
) -> None:
    """Send one shard to the peer at `addr` over a connection of its own; returns when the peer
    holds it verified. (`Pusher` keeps the connection for the next shard.)"""
    sock = connect(addr, secret)
    try:
        _send_put(sock, addr, header, header_bytes, region_path, origin)
    finally:
        sock.close()


class Pusher:
    """Pushes shards to peers over one connection per peer, kept open between pushes: a save
    every step otherwise pays a TCP connection, the HMAC challenge and a server thread each time.
    A connection idle for REUSE_S is not reused (the server closes it after KEEP_ALIVE_S); one
    that fails is closed and the push made once more on a new connection (the server read
    nothing of it, or holds the shard already). Used from one thread."""

    def __init__(self, secret: bytes):
        self.secret = secret
        self._kept: dict[str, tuple[socket.socket, float]] = {}  # addr -> (socket, last used)

    def push(
        self,
        addr: str,
        header: ShardHeader,
        header_bytes: bytes,
        region_path: Path,
        origin: str,
    ) -> None:
        """As `push`; ReplicationError when the peer cannot be reached or refuses the shard."""
        kept = self._kept.pop(addr, None)
        if kept is not None:
            sock, used = kept
            if time.monotonic() - used < REUSE_S:
                try:
                    _send_put(sock, addr, header, header_bytes, region_path, origin)
                except _Broken:
                    sock.close()  # the server closed it, or left: a new connection says which
                except BaseException:
                    sock.close()  # refused: the server ends the connection
                    raise
                else:
                    self._kept[addr] = (sock, time.monotonic())
                    return
            else:
                sock.close()
        sock = connect(addr, self.secret)
        try:
            _send_put(sock, addr, header, header_bytes, region_path, origin)
        except BaseException:
            sock.close()
            raise
        self._kept[addr] = (sock, time.monotonic())

    def close(self) -> None:
        for sock, _ in self._kept.values():
            sock.close()
        self._kept.clear()


class _Broken(ReplicationError):
    """The connection failed during a push (as opposed to the peer refusing the shard)."""


def _send_put(
    sock: socket.socket,
    addr: str,
    header: ShardHeader,
    header_bytes: bytes,
    region_path: Path,
    origin: str,
) -> None:
    """One "put" on `sock`: _Broken if the connection failed, ReplicationError (and the
    connection no longer usable: the server ends it) if the peer refused the shard."""
    try:
        send_msg(
            sock,
            {
                "op": "put",
                "step": header.step,
                "rank": header.rank,
                "origin": origin,
                "header_len": len(header_bytes),
                "data_len": header.data_len,
            },
            deadline_in(FRAME_TIMEOUT_S),
        )
        send_all(sock, header_bytes, transfer_deadline(len(header_bytes)))
        send_region(sock, region_path, header.data_len)
        reply = recv_msg(sock, deadline_in(TRANSFER_TIMEOUT_S), MAX_PEER_MESSAGE)
    except (OSError, ProtocolError) as e:
        raise _Broken(f"sending step {header.step} rank {header.rank} to {addr}: {e}") from e
    if reply.get("ok") is not True:
        raise ReplicationError(
            f"peer at {addr} refused step {header.step} rank {header.rank}: "
            f"{str(reply.get('error'))[:500]}"
        )


def fetch(addr: str, secret: bytes, step: int, rank: int) -> tuple[ShardHeader, memoryview]:
    """(header, data) of a shard held by the server at `addr`, checksums verified; the data is
    a view of private memory holding exactly the shard's data (layout.rebuild takes it as is)."""
    landed: list[memoryview] = []

    def into_anonymous(header: ShardHeader) -> memoryview:
        landed.append(memoryview(anonymous_buffer(header.data_len))[: header.data_len])
        return landed[0]

    header, _ = fetch_into(addr, secret, step, rank, into_anonymous)
    return header, landed[0]


def fetch_into(
    addr: str,
    secret: bytes,
    step: int,
    rank: int,
    destination: Callable[[ShardHeader], memoryview],
) -> tuple[ShardHeader, bytes]:
    """The header of a shard held by the server at `addr` and its bytes (as `recv_shard_header`
    gives them), its data received straight into
    `destination(header)` (asked for only once the header has been checked: its step, rank and
    a world size) and verified there. ReplicationError when the server cannot be reached or does
    not hold it, ShardError for a bad copy; whatever `destination` raises propagates. On any
    error the caller gives back what `destination` handed out."""
    sock = connect(addr, secret)
    try:
        send_msg(sock, {"op": "get", "step": step, "rank": rank}, deadline_in(FRAME_TIMEOUT_S))
        reply = recv_msg(sock, deadline_in(TRANSFER_TIMEOUT_S), MAX_PEER_MESSAGE)
        if reply.get("ok") is not True:
            raise ReplicationError(
                f"server at {addr} has no step {step} rank {rank}: {str(reply.get('error'))[:500]}"
            )
        try:
            header_len = field_int(reply, "header_len", MIN_HEADER_SPAN, MAX_HEADER_SPAN)
            data_len = field_int(reply, "data_len", 0, MAX_SHARD_BYTES)
        except ValueError as e:
            raise ReplicationError(f"server at {addr} sent a bad reply: {e}") from e
        header, header_bytes = recv_shard_header(sock, header_len, data_len)
        shard_format.check_identity(header, step, rank)
        view = destination(header)
        recv_into(sock, view, transfer_deadline(data_len))
    except (OSError, ProtocolError) as e:
        raise ReplicationError(f"fetching step {step} rank {rank} from {addr}: {e}") from e
    finally:
        sock.close()
    shard_format.verify_data(header, view)
    del view
    return header, header_bytes


def list_held(addr: str, secret: bytes, rank: int) -> list[tuple[int, int]]:
    """(step, world size) of each shard of `rank` the server at `addr` holds in memory.
    ReplicationError when it cannot be reached or its answer is not a well-formed listing."""
    sock = connect(addr, secret)
    try:
        send_msg(sock, {"op": "list", "rank": rank}, deadline_in(FRAME_TIMEOUT_S))
        reply = recv_msg(sock, deadline_in(FRAME_TIMEOUT_S), MAX_PEER_MESSAGE)
    except (OSError, ProtocolError) as e:
        raise ReplicationError(f"listing rank {rank}'s shards at {addr}: {e}") from e
    finally:
        sock.close()
    return parse_listing(reply, addr)


def parse_listing(reply: dict[str, Any], addr: str) -> list[tuple[int, int]]:
    """The (step, world size) pairs of a "list" reply from `addr`; ReplicationError for a
    reply that is not a well-formed listing (at most MAX_LISTED pairs of integers)."""
    held = reply.get("held") if reply.get("ok") is True else None
    if not isinstance(held, list) or len(held) > MAX_LISTED:
        raise ReplicationError(f"server at {addr} sent a bad listing: {str(reply)[:200]}")
    listing = []
    for item in held:
        if not (
            isinstance(item, list)
            and len(item) == 2
            and all(type(v) is int for v in item)
            and item[0] >= 0
            and item[1] >= 1
        ):
            raise ReplicationError(f"server at {addr} listed a bad entry: {str(item)[:80]}")
        listing.append((item[0], item[1]))
    return listing


def serve_list(sock: socket.socket, held: list[tuple[int, int]]) -> None:
    """Answer a "list" with `held`: (step, world size) pairs, at most MAX_LISTED (the newest)."""
    newest = sorted(held, reverse=True)[:MAX_LISTED]
    send_msg(sock, {"ok": True, "held": [list(h) for h in newest]}, deadline_in(FRAME_TIMEOUT_S))


def receive_put(
    sock: socket.socket,
    request: PutRequest,
    reserve: Callable[[int, int, int], Region],
    commit: Callable[[Region, ShardHeader | None, bytes], None],
) -> None:
    """Serve a "put": `reserve(step, rank, nbytes)` gives a region, `commit(region, header,
    header_bytes)` keeps it (`commit(region, None, b"")` gives it back). ShardError for a shard
    that is not the one announced or does not verify; nothing is reserved before its header has
    been checked."""
    header, header_bytes = recv_shard_header(sock, request.header_len, request.data_len)
    shard_format.check_identity(header, request.step, request.rank)
    region = reserve(request.step, request.rank, request.data_len)
    try:
        view = region.view()[: request.data_len]
        recv_into(sock, view, transfer_deadline(request.data_len))
        shard_format.verify_data(header, view)
        del view
    except BaseException:
        commit(region, None, b"")  # gives the region back
        raise
    commit(region, header, header_bytes)
    send_msg(sock, {"ok": True}, deadline_in(FRAME_TIMEOUT_S))


def refuse_put(sock: socket.socket, request: PutRequest, error: str) -> None:
    """Answer a put with `error`, then drop what its sender still sends (within limits)."""
    send_msg(sock, {"ok": False, "error": error}, deadline_in(FRAME_TIMEOUT_S))
    sock.shutdown(socket.SHUT_WR)
    deadline = deadline_in(DRAIN_TIMEOUT_S)
    left = min(DRAIN_MAX_BYTES, request.header_len + request.data_len)
    scratch = memoryview(bytearray(min(left, 1 << 20) or 1))
    try:
        while left > 0:
            recv_into(sock, scratch[: min(left, len(scratch))], deadline)
            left -= min(left, len(scratch))
    except ProtocolError:  # the sender stopped, or took too long: either way, done
        pass


def serve_get(sock: socket.socket, header_bytes: bytes, region_path: Path, data_len: int) -> None:
    send_msg(
        sock,
        {"ok": True, "header_len": len(header_bytes), "data_len": data_len},
        deadline_in(FRAME_TIMEOUT_S),
    )
    send_all(sock, header_bytes, transfer_deadline(len(header_bytes)))
    send_region(sock, region_path, data_len)
