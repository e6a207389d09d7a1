"""The server side of the peer protocol: other nodes' servers push replicas and fetch shards.

A TCP connection must pass the mutual HMAC challenge (the job's checkpoint secret) before any
request; a failed one is reported as an `auth` event. Then one request (replication.py has the
wire format):
    put  a replica arrives: it is written straight into a region of this server's memory,
         verified, and kept like a shard of this node (its origin is the sending node)
    get  a shard this server holds in memory is sent from its region (pinned meanwhile)
This module never decides placement or retention, and never reads shard bytes into Python.
"""

from __future__ import annotations

import logging
import socket

from transom.checkpoint import layout, replication
from transom.checkpoint.budget import BudgetExceeded, ShardMemory
from transom.checkpoint.pipeline import SavePipeline
from transom.checkpoint.protocol import AuthError, ProtocolError, authenticate, recv_msg, send_msg
from transom.checkpoint.publisher import Publisher
from transom.checkpoint.shm import Region
from transom.common.states import Tier

log = logging.getLogger("transom.ckpt.server")


class PeerService:
    def __init__(
        self,
        secret: bytes,
        memory: ShardMemory,
        pipeline: SavePipeline,
        publisher: Publisher,
    ):
        self.secret = secret
        self.memory = memory
        self.pipeline = pipeline
        self.publisher = publisher

    def serve(self, sock: socket.socket) -> None:
        """Authenticate one peer connection and answer its request."""
        try:
            sock.settimeout(replication.TRANSFER_TIMEOUT_S)
            authenticate(sock, self.secret, initiator=False)
        except AuthError as e:
            self.publisher.event(
                "auth", f"rejected a peer connection from {sock.getpeername()[0]}: {e}"
            )
            return
        except (ProtocolError, OSError):
            return
        try:
            msg = recv_msg(sock)
            if msg.get("op") == "put":
                self._put(sock, msg)
            elif msg.get("op") == "get":
                self._get(sock, int(msg["step"]), int(msg["rank"]))
            else:
                send_msg(sock, {"ok": False, "error": f"unknown request {msg.get('op')!r}"})
        except (ProtocolError, OSError, KeyError, ValueError) as e:
            log.warning("peer request failed: %s", e)

    def _put(self, sock: socket.socket, msg: dict) -> None:
        origin = str(msg.get("origin", "peer"))
        step, rank = int(msg["step"]), int(msg["rank"])

        def reserve(step: int, rank: int, nbytes: int) -> Region:
            return self.memory.reserve(step, rank, nbytes, world_size=-1, origin=origin)

        def commit(region: Region, header: dict | None) -> None:
            if header is None:
                self.memory.abort(step, rank, region)
                return
            with self.memory.lock:
                shard = self.memory.shards[(step, rank)]
                shard.header, shard.world_size = header, header["world_size"]
                shard.header_bytes = layout.encode_header(header)
            self.pipeline.committed(shard)

        try:
            replication.receive_put(sock, msg, reserve, commit)
        except (BudgetExceeded, layout.ShardError) as e:
            send_msg(sock, {"ok": False, "error": str(e)})

    def _get(self, sock: socket.socket, step: int, rank: int) -> None:
        with self.memory.lock:
            shard = self.memory.shards.get((step, rank))
            ok = shard is not None and Tier.MEMORY in shard.tiers
            if shard is not None and ok:
                shard.pins += 1
        if shard is None or not ok:
            send_msg(sock, {"ok": False, "error": "not held here"})
            return
        try:
            assert shard.header is not None
            replication.serve_get(
                sock, shard.header_bytes, shard.region.path, shard.header["data_len"]
            )
        finally:
            self.memory.unpin(shard)
