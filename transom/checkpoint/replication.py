"""Shard transfer between nodes over TCP: push a replica to a peer's server, fetch one back.

A connection starts with the mutual HMAC challenge of protocol.py (the job's checkpoint secret),
then carries requests:
    {"op": "put", "step", "rank", "header_len", "data_len", "origin"} + header bytes + data bytes
        -> {"ok": true} once the receiver holds the shard in memory with its checksums verified
    {"op": "get", "step", "rank"} -> {"ok": true, "header_len", "data_len"} + header + data
Data leaves a region with sendfile (no copy through Python) and lands with recv_into straight in
the destination memory. The placement rule (`ring_peer`) puts a node's replicas on the next member
of the plan's ring, so losing one node never loses both copies of a shard. This module moves
bytes; it never decides what a server keeps.
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from transom.checkpoint import layout
from transom.checkpoint.protocol import ProtocolError, authenticate, recv_into, recv_msg, send_msg
from transom.checkpoint.shm import anonymous_buffer, as_bytes

CONNECT_TIMEOUT_S = 5.0
TRANSFER_TIMEOUT_S = 120.0
SOCKET_BUFFER = 4 << 20


class ReplicationError(ConnectionError):
    """A peer could not be reached, refused the shard, or sent a bad one."""


def ring_peer(members: list[str], node: str) -> str | None:
    """The node after `node` in the ring of `members` (None when alone or not a member)."""
    if node not in members or len(members) < 2:
        return None
    return members[(members.index(node) + 1) % len(members)]


def connect(addr: str, secret: bytes) -> socket.socket:
    host, _, port = addr.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
        raise ReplicationError(f"cannot reach checkpoint server at {addr}: {e}") from e
    sock.settimeout(TRANSFER_TIMEOUT_S)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
    try:
        authenticate(sock, secret, initiator=True)
    except (ProtocolError, OSError) as e:
        sock.close()
        raise ReplicationError(f"checkpoint server at {addr}: {e}") from e
    return sock


def send_region(sock: socket.socket, region_path: Path, nbytes: int) -> None:
    """The first `nbytes` of a region file, kernel to kernel."""
    if nbytes == 0:
        return
    with open(region_path, "rb") as f:
        sock.sendfile(f, 0, nbytes)


def push(
    addr: str, secret: bytes, header: dict, header_bytes: bytes, region_path: Path, origin: str
) -> None:
    """Send one shard to the peer at `addr`; returns when the peer holds it verified."""
    sock = connect(addr, secret)
    try:
        send_msg(
            sock,
            {
                "op": "put",
                "step": header["step"],
                "rank": header["rank"],
                "origin": origin,
                "header_len": len(header_bytes),
                "data_len": header["data_len"],
            },
        )
        sock.sendall(header_bytes)
        send_region(sock, region_path, header["data_len"])
        reply = recv_msg(sock)
    except (OSError, ProtocolError) as e:
        raise ReplicationError(
            f"sending step {header['step']} rank {header['rank']} to {addr}: {e}"
        ) from e
    finally:
        sock.close()
    if not reply.get("ok"):
        raise ReplicationError(
            f"peer at {addr} refused step {header['step']} rank {header['rank']}: "
            f"{reply.get('error')}"
        )


def fetch(addr: str, secret: bytes, step: int, rank: int) -> tuple[dict, torch.Tensor]:
    """(header, data) of a shard held by the server at `addr`, checksums verified."""
    sock = connect(addr, secret)
    try:
        send_msg(sock, {"op": "get", "step": step, "rank": rank})
        reply = recv_msg(sock)
        if not reply.get("ok"):
            raise ReplicationError(
                f"server at {addr} has no step {step} rank {rank}: {reply.get('error')}"
            )
        head = bytearray(reply["header_len"])
        recv_into(sock, memoryview(head))
        header, _ = layout.decode_header(bytes(head))
        layout.check_identity(header, step, rank)
        data_len = header["data_len"]
        buf = anonymous_buffer(data_len)
        view = memoryview(buf)[:data_len]
        recv_into(sock, view)
    except (OSError, ProtocolError) as e:
        raise ReplicationError(f"fetching step {step} rank {rank} from {addr}: {e}") from e
    finally:
        sock.close()
    layout.verify_data(header, view)
    del view
    return header, as_bytes(buf)[:data_len]


def receive_put(sock: socket.socket, msg: dict, reserve, commit) -> None:
    """Serve a "put": `reserve(step, rank, nbytes)` gives a region, `commit(region, header)`
    keeps it (`commit(region, None)` gives it back)."""
    head = bytearray(int(msg["header_len"]))
    recv_into(sock, memoryview(head))
    header, _ = layout.decode_header(bytes(head))
    layout.check_identity(header, msg["step"], msg["rank"])
    region = reserve(header["step"], header["rank"], header["data_len"])
    try:
        view = region.view()[: header["data_len"]]
        recv_into(sock, view)
        layout.verify_data(header, view)
        del view
    except BaseException:
        commit(region, None)  # gives the region back
        raise
    commit(region, header)
    send_msg(sock, {"ok": True})


def serve_get(sock: socket.socket, header_bytes: bytes, region_path: Path, data_len: int) -> None:
    send_msg(sock, {"ok": True, "header_len": len(header_bytes), "data_len": data_len})
    sock.sendall(header_bytes)
    send_region(sock, region_path, data_len)
