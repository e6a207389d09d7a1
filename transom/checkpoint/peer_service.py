"""The server side of the peer protocol: other nodes' servers push replicas and fetch shards.

A TCP connection must pass the mutual HMAC challenge (the job's checkpoint secret) within
AUTH_TIMEOUT_S, or it is closed (peer_port.py runs the challenge); failed challenges are reported
here as an `auth` event, at most once a minute with their count. Then one request, read within
FRAME_TIMEOUT_S and validated by `replication.parse_request` (replication.py has the wire
format), or a series of puts, each accepted one followed by the next within KEEP_ALIVE_S:
    put  a replica arrives: it is written straight into a region of this server's memory,
         verified, and kept like a shard of this node (its origin is the sending node). A
         replica may replace an earlier replica of the same step and rank (a step saved again
         after a rollback), never a shard of this node's own workers.
    get  a shard this server holds in memory is sent from its region (pinned meanwhile)
    list the steps of a rank's shards this server holds in memory (a replacement node's server
         asks, to restore the newest step: worker_service.py `held`)
A request that is malformed, too large or late ends its connection, with an error reply where
one can still be sent; it never raises out of `serve`'s caller's thread into anything shared.
This module never decides placement or retention, and never reads shard bytes into Python.
"""

from __future__ import annotations

import logging
import socket
import time

from transom.checkpoint import replication, shard_format
from transom.checkpoint.budget import COMMITTED, LOCAL, BudgetExceeded, ShardMemory
from transom.checkpoint.peer_port import Throttle
from transom.checkpoint.pipeline import SavePipeline
from transom.checkpoint.protocol import (
    FRAME_TIMEOUT_S,
    AuthError,
    ConnectionClosed,
    ProtocolError,
    ProtocolTimeout,
    deadline_in,
    recv_msg,
    send_msg,
)
from transom.checkpoint.publisher import Publisher
from transom.checkpoint.shard_format import ShardHeader
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
        self._auth_reports = Throttle()
        self._request_reports = Throttle()

    def serve(self, sock: socket.socket) -> None:
        """Answer the requests of one peer connection that peer_port.py saw authenticate: one,
        or puts for as long as the server accepts them and the next comes within KEEP_ALIVE_S
        (replication.Pusher keeps its connection between the saves of every step)."""
        wait_s = FRAME_TIMEOUT_S
        try:
            while True:
                try:
                    msg = recv_msg(sock, deadline_in(wait_s), replication.MAX_PEER_MESSAGE)
                except (ConnectionClosed, ProtocolTimeout):
                    if wait_s == FRAME_TIMEOUT_S:
                        raise
                    return  # the pusher is done with it, or idle: a next put connects again
                try:
                    request = replication.parse_request(msg)
                except ValueError as e:
                    send_msg(
                        sock,
                        {"ok": False, "error": f"bad request: {e}"},
                        deadline_in(FRAME_TIMEOUT_S),
                    )
                    raise
                if isinstance(request, replication.PutRequest):
                    if not self._put(sock, request):
                        return
                    wait_s = replication.KEEP_ALIVE_S
                    continue
                if isinstance(request, replication.ListRequest):
                    replication.serve_list(sock, self.memory.held(request.rank))
                else:
                    self._get(sock, request.step, request.rank)
                return
        except (ProtocolError, OSError, ValueError) as e:
            count = self._request_reports.hit()
            if count:
                log.warning("peer request failed (%d since the last report): %s", count, e)

    def auth_failed(self, sock: socket.socket, error: AuthError) -> None:
        """Report a connection that failed the challenge (peer_port.py calls it), throttled."""
        count = self._auth_reports.hit()
        if count is None:
            return
        try:
            who = sock.getpeername()[0]
        except OSError:
            who = "a peer that left"
        self.publisher.event(
            "auth",
            f"rejected {count} peer connection(s) since the last report, the latest from "
            f"{who}: {error}",
            count=count,
        )

    def _drop_older_replicas(self, step: int, rank: int) -> None:
        """Evict the replicas of `rank` older than `step` that nothing uses (lock held)."""
        for old in list(self.memory.shards.values()):
            if (
                old.rank == rank
                and old.origin != LOCAL
                and old.step < step
                and old.state == COMMITTED
                and not old.pins
                and old.step != self.memory.protected_step
            ):
                self.memory.evict(old)

    def _put(self, sock: socket.socket, request: replication.PutRequest) -> bool:
        """Receive a replica; False if it was refused (the connection is then over)."""
        step, rank, origin = request.step, request.rank, request.origin

        def reserve(step: int, rank: int, nbytes: int) -> Region:
            if origin == LOCAL:
                raise BudgetExceeded(f"a replica cannot name {LOCAL!r} as its origin")
            with self.memory.lock:
                held = self.memory.shards.get((step, rank))
                if held is not None and held.origin == LOCAL:
                    raise BudgetExceeded(
                        f"step {step} rank {rank} is a shard of this node's own workers here"
                    )
                # One replica per rank, and the previous one kept until the next is complete
                # (`commit`) where the budget has room for both: a peer that dies while its
                # next replica arrives leaves the one before, not nothing. Without room the
                # older one makes way now (its region takes the new one): replicas cost this
                # node 1x its peer's share.
                if not self.memory.fits_without_evicting(nbytes):
                    self._drop_older_replicas(step, rank)
            return self.memory.reserve(step, rank, nbytes, world_size=-1, origin=origin)

        def commit(region: Region, header: ShardHeader | None, header_bytes: bytes) -> None:
            if header is None:
                self.memory.abort(step, rank, region)
                return
            generation = header.timeline.generation if header.timeline is not None else 0
            stale = (
                self.publisher.stale_generation(generation)
                if generation > 0  # 0: saved outside a launcher
                else None
            )
            if stale is not None:
                self.memory.abort(step, rank, region)
                raise shard_format.ShardError(
                    f"replica of step {step} rank {rank} refused: {stale}"
                )
            with self.memory.lock:
                shard = self.memory.shards[(step, rank)]
                shard.header, shard.world_size = header, header.world_size
                shard.header_bytes = header_bytes
                shard.staged_at = time.time()
            if self.pipeline.committed(shard):
                with self.memory.lock:
                    self._drop_older_replicas(step, rank)

        try:
            replication.receive_put(sock, request, reserve, commit)
        except (BudgetExceeded, shard_format.ShardError) as e:
            replication.refuse_put(sock, request, str(e))
            return False
        return True

    def _get(self, sock: socket.socket, step: int, rank: int) -> None:
        with self.memory.lock:
            shard = self.memory.shards.get((step, rank))
            ok = shard is not None and Tier.MEMORY in shard.tiers
            if shard is not None and ok:
                shard.pins += 1
        if shard is None or not ok:
            send_msg(sock, {"ok": False, "error": "not held here"}, deadline_in(FRAME_TIMEOUT_S))
            return
        try:
            assert shard.header is not None
            replication.serve_get(
                sock, shard.header_bytes, shard.region.path, shard.header.data_len
            )
        finally:
            self.memory.unpin(shard)
