"""Message framing and peer authentication for the checkpoint server's two sockets.

Both the workers' Unix socket and the peers' TCP socket carry messages framed as a 4-byte
big-endian length and a JSON object; shard bytes follow a message raw, their length named in it.
Peers prove they hold the job's secret with an HMAC-SHA256 challenge in both directions before
any other message; the secret itself never crosses the wire. Nothing here interprets requests.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct

LENGTH = struct.Struct(">I")
MAX_MESSAGE = 64 << 20
NONCE_BYTES = 32
RECV_CHUNK = 8 << 20


class ProtocolError(ConnectionError):
    """The other side closed the connection or sent something that is not a valid message."""


class AuthError(ProtocolError):
    """The other side does not hold the job's checkpoint secret."""


def send_msg(sock: socket.socket, msg: dict) -> None:
    body = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(LENGTH.pack(len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket (no intermediate copies)."""
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got : got + RECV_CHUNK])
        if k == 0:
            raise ProtocolError(f"connection closed after {got} of {n} bytes")
        got += k


def recv_msg(sock: socket.socket) -> dict:
    try:
        (n,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    except ProtocolError as e:
        raise ProtocolError("connection closed") from e
    if n > MAX_MESSAGE:
        raise ProtocolError(f"message of {n} bytes is too large")
    try:
        msg = json.loads(recv_exact(sock, n))
    except ValueError as e:
        raise ProtocolError(f"message is not JSON: {e}") from e
    if not isinstance(msg, dict):
        raise ProtocolError("message is not a JSON object")
    return msg


def _proof(secret: bytes, nonce: bytes, role: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def authenticate(sock: socket.socket, secret: bytes, initiator: bool) -> None:
    """Mutual challenge-response; raises AuthError when the other side's proof is wrong."""
    mine = os.urandom(NONCE_BYTES)
    sock.sendall(mine)
    theirs = recv_exact(sock, NONCE_BYTES)
    me, them = (b"client", b"server") if initiator else (b"server", b"client")
    sock.sendall(_proof(secret, theirs, me))
    proof = recv_exact(sock, hashlib.sha256().digest_size)
    if not hmac.compare_digest(proof, _proof(secret, mine, them)):
        raise AuthError("peer failed authentication: wrong checkpoint secret")
