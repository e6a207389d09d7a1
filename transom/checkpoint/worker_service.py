"""The requests of this node's workers, on the server's Unix socket: served here.

Each message (protocol.py framing) is one request with one reply; worker_protocol.py defines
each request and reply as a record and is the one parser of a request, so every field has been
checked (types, bounds, a shard at most MAX_SHARD_BYTES) before anything here sees it:
    Reserve  a region to copy the shard into (refused for a generation older than the plan's)
    Commit   the copy is done (the save pipeline takes over); persist false: memory and peer only;
             its header's tables may be the ones sent before on the connection (header_tables.py)
    Abort    the copy failed: give the region back
    Persist  a shard saved memory-only goes to storage too (pipeline.persist_later)
    Wait     once the shard reached (or failed) a `Tier`
    Locate   where the shard can be read, fastest first (after a prefetch of it under way,
             prefetch.py, at most PREFETCH_WAIT_S)
    Prepare  populate a spare region for the rank's next save
    Steps    steps restorable for every rank, newest first
    Held     steps of the rank's shard saved by a world of world_size, floor <= step < before,
             held in this server's memory or (when it holds none) in the memory of the peers
             that may hold them (`peers_to_ask`, asked directly: the catalog lags the newest
             saves); `locate` then names those peers too
    Event    a `checkpoint` event on the worker's behalf (a corrupt `bad-copy`, whose fields
             are read as bad_copy.py's `BadCopy`, also withdraws that copy)
    Status   what the server holds, and what became of its prefetches
A refused save is a `Failed` with `refused`; a bad request (a field of the wrong type or out of
bounds) a `Failed`. A connection may idle between requests, but a request must arrive within
FRAME_TIMEOUT_S of its first byte and its reply be taken within REPLY_TIMEOUT_S, or the
connection is closed. Regions a connection reserved and never committed are given back when it
closes. The worker gives up on a reply after its own limit (engine.py); this module only routes
requests, and never holds shard bytes.
"""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path
from typing import Any, NoReturn

from transom.checkpoint import catalog, replication, storage
from transom.checkpoint.bad_copy import BAD_COPY, BadCopy
from transom.checkpoint.budget import COMMITTED, STAGED, BudgetExceeded, ShardMemory
from transom.checkpoint.header_tables import ConnectionTables
from transom.checkpoint.pipeline import SavePipeline
from transom.checkpoint.prefetch import Prefetcher
from transom.checkpoint.protocol import ProtocolError, deadline_in, recv_msg, send_msg
from transom.checkpoint.publisher import Publisher
from transom.checkpoint.reshard_steps import reshardable, restorable
from transom.checkpoint.server_options import ServerConfig
from transom.checkpoint.shard_format import ShardError
from transom.checkpoint.shm import Region
from transom.checkpoint.worker_protocol import (
    Abort,
    Commit,
    Done,
    Event,
    Failed,
    Held,
    Locate,
    Located,
    Persist,
    Prepare,
    Reply,
    Reserve,
    Source,
    StatusRequest,
    StepList,
    Steps,
    Wait,
    parse_request,
)
from transom.checkpoint.worker_protocol import Region as RegionReply
from transom.common.names import valid_id
from transom.common.states import Tier

log = logging.getLogger("transom.ckpt.server")

# A load of a shard whose checksums are still being computed waits this long for them (the
# worker's `locate` waits longer: engine.LOCATE_TIMEOUT_S).
STAGED_WAIT_S = 30.0
# A worker that does not take its reply within this is gone or stuck: its connection is closed.
REPLY_TIMEOUT_S = 10.0


class WorkerService:
    def __init__(
        self,
        cfg: ServerConfig,
        memory: ShardMemory,
        pipeline: SavePipeline,
        publisher: Publisher,
        prefetcher: Prefetcher | None = None,
    ):
        self.cfg = cfg
        self.prefetcher = prefetcher
        self.node = cfg.node_id
        self.memory = memory
        self.lock = memory.lock
        self.pipeline = pipeline
        self.publisher = publisher
        # (step, rank) -> peers (node, address) that said they hold it (`held`), for `locate`;
        # a rank's entries below the floor of its newest `held` are dropped.
        self.peer_holders: dict[tuple[int, int], list[tuple[str, str]]] = {}
        self._holders_lock = threading.Lock()

    def serve(self, sock: socket.socket) -> None:
        """Answer one worker connection's requests until it closes."""
        reserved: dict[tuple[int, int], Region] = {}
        tables = ConnectionTables()
        try:
            while True:
                try:
                    msg = recv_msg(sock)
                except (ProtocolError, OSError):
                    return
                try:
                    reply = self.handle(msg, reserved, tables)
                except (BudgetExceeded, ShardError, KeyError, ValueError, TypeError) as e:
                    reply = Failed(str(e), refused=isinstance(e, BudgetExceeded))
                try:
                    send_msg(sock, reply.to_msg(), deadline_in(REPLY_TIMEOUT_S))
                except (ProtocolError, OSError):
                    return
        finally:
            for (step, rank), region in reserved.items():
                self.memory.abort(step, rank, region)

    def handle(
        self,
        msg: dict[str, Any],
        reserved: dict[tuple[int, int], Region],
        tables: ConnectionTables,
    ) -> Reply | Failed:
        """The reply to one message of a connection that reserved `reserved` and sent `tables`
        (ValueError for a bad request, BudgetExceeded for a save refused)."""
        request = parse_request(msg)
        match request:
            case Reserve():
                return self.reserve(request, reserved)
            case Commit():
                header = tables.header(request)  # before the region is taken: it may be resent
                region = reserved.pop((request.step, request.rank))
                self.pipeline.commit(request.step, request.rank, region, header, request.persist)
                return Done()
            case Abort():
                aborted = reserved.pop((request.step, request.rank), None)
                if aborted is not None:
                    self.memory.abort(request.step, request.rank, aborted)
                return Done()
            case Persist():
                if not self.pipeline.persist_later(request.step, request.rank):
                    return Failed(f"step {request.step} rank {request.rank} is not held here")
                return Done()
            case Wait():
                return self.pipeline.wait(request.step, request.rank, request.tier, request.timeout)
            case Locate():
                return Located(self.locate(request.step, request.rank))
            case Prepare():
                spare = self.memory.prepare_spare(request.nbytes, request.rank, request.persist)
                if spare is None:
                    return Failed("no room in the memory budget for a spare region")
                return RegionReply(str(spare.path), request.nbytes)
            case Held():
                held = self.held(request.rank, request.world_size, request.floor, request.before)
                return StepList(held)
            case Steps():
                return StepList(self.steps(request.world_size))
            case Event():
                self.publisher.event(request.action, request.message, **request.fields)
                if request.action == BAD_COPY:
                    bad = BadCopy.from_dict(request.fields)  # RecordError: a bad request
                    if bad.corrupt:
                        self.withdraw_corrupt(bad)
                return Done()
            case StatusRequest():
                prefetch = self.prefetcher.status() if self.prefetcher is not None else []
                return self.memory.status(self.node, self.publisher.addr, prefetch)
        unserved(request)

    def reserve(self, request: Reserve, reserved: dict[tuple[int, int], Region]) -> RegionReply:
        step, rank = request.step, request.rank
        if request.generation is not None:  # a worker of a replaced generation: refused
            stale = self.publisher.stale_generation(request.generation)
            if stale is not None:
                raise BudgetExceeded(f"save of step {step} rank {rank} refused: {stale}")
        region = self.memory.reserve(
            step, rank, request.nbytes, request.world_size, ahead=request.ahead
        )
        reserved[(step, rank)] = region
        return RegionReply(str(region.path), region.nbytes)

    def withdraw_corrupt(self, bad: BadCopy) -> None:
        """A worker found a copy corrupt (its checksums failed): no restore may be planned from it
        again. A copy in this server's memory is evicted; the listing of a peer's or storage's
        copy leaves the catalog (the file stays, for inspection). When a rank's every copy of
        its restore step is corrupt, its load fails, and the next generation's restore step is
        an older one, the same for every rank (catalog.restorable_steps)."""
        step, rank = bad.step, bad.rank
        tier, node = Tier.parse(bad.tier), bad.holder_node
        if tier is Tier.MEMORY:
            with self.lock:
                shard = self.memory.shards.get((step, rank))
                if shard is not None and shard.state == COMMITTED and not shard.pins:
                    self.memory.evict(shard)
            holder = catalog.memory_holder(self.node)
        elif tier is Tier.PEER and node is not None and valid_id(node):
            holder = catalog.memory_holder(node)
        elif tier is Tier.STORAGE:
            holder = catalog.STORAGE_HOLDER
        else:
            return
        self.publisher.withdraw(step, rank, holder)
        log.warning("step %d rank %d: corrupt copy in %s withdrawn (%s)", step, rank, tier, holder)

    def locate(self, step: int, rank: int) -> list[Source]:
        """Where shard (step, rank) can be read from, fastest first."""
        if self.prefetcher is not None:  # a prefetch of it under way: wait for it (bounded)
            self.prefetcher.join(step, rank)
        sources: list[Source] = []
        with self.lock:
            shard = self.memory.shards.get((step, rank))
            if shard is not None and shard.state == STAGED:  # saved a moment ago: checksums soon
                self.lock.wait_for(
                    lambda: shard.state != STAGED or Tier.MEMORY in shard.failed,
                    timeout=STAGED_WAIT_S,
                )
            if shard is not None and Tier.MEMORY in shard.tiers:
                shard.region.loaned = True  # the worker maps it: never write into it again
                path = str(shard.region.path)
                sources.append(Source(Tier.MEMORY, self.node, path, header=shard.header))
            if shard is not None and Tier.PEER in shard.tiers and self.cfg.peer:
                sources.append(Source(Tier.PEER, addr=self.cfg.peer))  # its node: unknown here
        for copy in self.publisher.memory_copies(step, rank):
            if copy.node != self.node and valid_id(copy.node):
                sources.append(Source(Tier.PEER, copy.node, addr=copy.addr))
        listed = {s.addr for s in sources}
        with self._holders_lock:
            said = list(self.peer_holders.get((step, rank), []))
        for node, addr in said:
            if addr not in listed:  # a peer that said it holds it, not (yet) in the catalog
                sources.append(Source(Tier.PEER, node, addr=addr))
        if self.cfg.storage_dir is not None:
            path = str(storage.shard_path(self.cfg.storage_dir, step, rank))
            if Path(path).exists():
                sources.append(Source(Tier.STORAGE, path=path))
        return sources

    def held(self, rank: int, world_size: int, floor: int, before: int | None) -> list[int]:
        """Steps of `rank`'s shard saved by a world of `world_size` in [floor, before), newest
        first: this server's memory, or, when that holds none (a node that replaces another, a
        rank that moved), the memory of each of `peers_to_ask` (asked directly; one that cannot
        be reached is skipped). Each peer's answer is remembered for `locate`."""

        def wanted(step: int, size: int) -> bool:
            return size == world_size and step >= floor and (before is None or step < before)

        steps = {step for step, size in self.memory.held(rank) if wanted(step, size)}
        if steps:
            return sorted(steps, reverse=True)
        with self._holders_lock:
            for key in [k for k in self.peer_holders if k[1] == rank and k[0] < floor]:
                del self.peer_holders[key]
        for node, addr in self.peers_to_ask(floor, rank).items():
            try:
                listing = replication.list_held(addr, self.cfg.secret, rank)
            except replication.ReplicationError as e:
                log.warning("%s", e)
                continue
            for step, size in listing:
                if wanted(step, size):
                    steps.add(step)
                    with self._holders_lock:
                        holders = self.peer_holders.setdefault((step, rank), [])
                        if (node, addr) not in holders:
                            holders.append((node, addr))
        return sorted(steps, reverse=True)

    def peers_to_ask(self, floor: int, rank: int) -> dict[str, str]:
        """The other nodes whose memory may hold `rank`'s newest shards, with their addresses:
        those the catalog lists as holding `floor`, and the node that ran the rank in the
        generation before and that node's ring peer (its replicas' holder; the catalog lists
        their newest shards up to a second late)."""
        peers = dict(self.publisher.memory_copies(floor, rank))
        before, per_node = self.publisher.plan.previous_members, self.cfg.ranks_per_node
        if per_node >= 1 and rank // per_node < len(before):
            ran = before[rank // per_node]
            for node in (ran, replication.ring_peer(before, ran)):
                addr = self.publisher.peer_addr(node) if node and node not in peers else None
                if node and addr:
                    peers[node] = addr
        peers.pop(self.node, None)
        return peers

    def steps(self, world_size: int) -> list[int]:
        """Steps restorable for every rank of a world of `world_size`, newest first: the
        catalog's answer, or (without etcd) what this server's memory and storage hold."""
        listed = self.publisher.restorable_steps(world_size)
        if listed is not None:
            return listed
        held = [
            (s.step, s.rank, s.world_size, reshardable(s.header))
            for s in self.memory.holding(Tier.MEMORY)
        ]
        steps = restorable(held, world_size)
        if self.cfg.storage_dir is not None:
            steps.update(storage.restorable_steps(Path(self.cfg.storage_dir), world_size))
        return sorted(steps, reverse=True)


def unserved(request: NoReturn) -> NoReturn:
    """A request kind `handle` does not serve (mypy rejects any call that can be reached)."""
    raise AssertionError(f"unserved request {request!r}")
