"""The requests of this node's workers, on the server's Unix socket.

Each message (protocol.py framing) is one request with one reply:
    reserve {step, rank, nbytes, world_size[, generation]} -> {path, nbytes} a region to copy the
                                       shard into (refused for a generation older than the plan's)
    commit  {step, rank, header, persist?}   the copy is done (the save pipeline takes over);
                                             persist false: memory and peer only
    abort   {step, rank}                     the copy failed: give the region back
    wait    {step, rank, tier, timeout}      once the shard reached (or failed) a `Tier`
    locate  {step, rank}      -> {sources}   where the shard can be read, fastest first (after
                                       a prefetch of it under way, prefetch.py, at most
                                       PREFETCH_WAIT_S)
    prepare {nbytes, rank}    -> {path}      populate a spare region for the rank's next save
    steps   {world_size}      -> {steps}     steps restorable for every rank, newest first
    held    {rank, world_size, floor[, before]} -> {steps}  steps of the rank's shard saved by a
                                       world of world_size, floor <= step < before, held in
                                       this server's memory or (when it holds none) in the
                                       memory of the peers that may hold them (`peers_to_ask`,
                                       asked directly: the catalog lags the newest saves);
                                       `locate` then names those peers too
    event   {action, message, fields}        a `checkpoint` event on the worker's behalf (a
                                       corrupt `bad-copy` also withdraws that copy)
    status                    -> what the server holds, and what became of its prefetches
A refused save answers {"ok": false, "refused": true, "error"}; a bad request (a field of the
wrong type or out of bounds, a shard over MAX_SHARD_BYTES) {"ok": false, "error"}. A connection
may idle between requests, but a request must arrive within FRAME_TIMEOUT_S of its first byte and
its reply be taken within REPLY_TIMEOUT_S, or the connection is closed. Regions a connection
reserved and never committed are given back when it closes. The worker gives up on a reply after
its own limit (engine.py); this module only parses requests and routes them, and never holds
shard bytes.
"""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path
from typing import Any

from transom.checkpoint import catalog, replication, storage
from transom.checkpoint.budget import COMMITTED, STAGED, BudgetExceeded, ShardMemory
from transom.checkpoint.pipeline import SavePipeline
from transom.checkpoint.prefetch import Prefetcher
from transom.checkpoint.protocol import (
    MAX_SHARD_BYTES,
    ProtocolError,
    deadline_in,
    field_int,
    recv_msg,
    send_msg,
)
from transom.checkpoint.publisher import Publisher
from transom.checkpoint.reshard_steps import reshardable, restorable
from transom.checkpoint.server_options import ServerConfig
from transom.checkpoint.shard_format import ShardError
from transom.checkpoint.shm import Region
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
        try:
            while True:
                try:
                    msg = recv_msg(sock)
                except (ProtocolError, OSError):
                    return
                try:
                    reply = self.handle(msg, reserved)
                except (BudgetExceeded, ShardError, KeyError, ValueError, TypeError) as e:
                    reply = {"ok": False, "error": str(e), "refused": isinstance(e, BudgetExceeded)}
                try:
                    send_msg(sock, reply, deadline_in(REPLY_TIMEOUT_S))
                except (ProtocolError, OSError):
                    return
        finally:
            for (step, rank), region in reserved.items():
                self.memory.abort(step, rank, region)

    def handle(self, msg: dict, reserved: dict[tuple[int, int], Region]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "reserve":
            step, rank = field_int(msg, "step"), field_int(msg, "rank")
            nbytes = field_int(msg, "nbytes", 0, MAX_SHARD_BYTES)
            world_size = field_int(msg, "world_size", 1)
            if "generation" in msg:  # a worker of a replaced generation: refused
                stale = self.publisher.stale_generation(field_int(msg, "generation"))
                if stale is not None:
                    raise BudgetExceeded(f"save of step {step} rank {rank} refused: {stale}")
            region = self.memory.reserve(step, rank, nbytes, world_size)
            reserved[(step, rank)] = region
            return {"ok": True, "path": str(region.path), "nbytes": region.nbytes}
        if op == "commit":
            step, rank = field_int(msg, "step"), field_int(msg, "rank")
            header = msg.get("header")
            if not isinstance(header, dict):
                raise ValueError("commit needs the shard's header (an object)")
            persist = msg.get("persist", True)
            if not isinstance(persist, bool):
                raise ValueError(f"persist must be true or false, not {str(persist)[:40]!r}")
            region = reserved.pop((step, rank))
            self.pipeline.commit(step, rank, region, header, persist)
            return {"ok": True}
        if op == "abort":
            step, rank = field_int(msg, "step"), field_int(msg, "rank")
            aborted = reserved.pop((step, rank), None)
            if aborted is not None:
                self.memory.abort(step, rank, aborted)
            return {"ok": True}
        if op == "wait":
            tier = Tier.parse(msg.get("tier"))
            step, rank = field_int(msg, "step"), field_int(msg, "rank")
            return self.pipeline.wait(step, rank, tier, parse_timeout(msg.get("timeout")))
        if op == "locate":
            step, rank = field_int(msg, "step"), field_int(msg, "rank")
            return {"ok": True, "sources": self.locate(step, rank)}
        if op == "prepare":
            nbytes = field_int(msg, "nbytes", 0, MAX_SHARD_BYTES)
            rank = field_int(msg, "rank") if "rank" in msg else 0
            spare = self.memory.prepare_spare(nbytes, rank)
            return {"ok": spare is not None, "path": spare and str(spare.path), "nbytes": nbytes}
        if op == "held":
            rank, world_size = field_int(msg, "rank"), field_int(msg, "world_size", 1)
            floor = field_int(msg, "floor")
            before = field_int(msg, "before") if msg.get("before") is not None else None
            return {"ok": True, "steps": self.held(rank, world_size, floor, before)}
        if op == "steps":
            return {"ok": True, "steps": self.steps(field_int(msg, "world_size", 1))}
        if op == "event":
            action, message = msg.get("action", "restored"), msg.get("message", "")
            fields = msg.get("fields", {})
            if not (isinstance(action, str) and isinstance(message, str)):
                raise ValueError("an event's action and message are strings")
            if not isinstance(fields, dict) or {"action", "message"} & set(fields):
                raise ValueError("an event's fields are an object without action or message")
            self.publisher.event(action, message, **fields)
            if action == "bad-copy" and fields.get("corrupt") is True:
                self.withdraw_corrupt(fields)
            return {"ok": True}
        if op == "status":
            return {
                "ok": True,
                "node": self.node,
                "addr": self.publisher.addr,
                **self.memory.status(),
                "prefetch": self.prefetcher.status() if self.prefetcher is not None else [],
            }
        raise ValueError(f"unknown request {str(op)[:40]!r}")

    def withdraw_corrupt(self, fields: dict) -> None:
        """A worker found a copy corrupt (its checksums failed): no restore may be planned from it
        again. A copy in this server's memory is evicted; the listing of a peer's or storage's
        copy leaves the catalog (the file stays, for inspection). When a rank's every copy of
        its restore step is corrupt, its load fails, and the next generation's restore step is
        an older one, the same for every rank (catalog.restorable_steps)."""
        step, rank = field_int(fields, "step"), field_int(fields, "rank")
        tier, node = Tier.parse(fields.get("tier")), fields.get("holder_node")
        if tier is Tier.MEMORY:
            with self.lock:
                shard = self.memory.shards.get((step, rank))
                if shard is not None and shard.state == COMMITTED and not shard.pins:
                    self.memory.evict(shard)
            holder = catalog.memory_holder(self.node)
        elif tier is Tier.PEER and isinstance(node, str) and valid_id(node):
            holder = catalog.memory_holder(node)
        elif tier is Tier.STORAGE:
            holder = catalog.STORAGE_HOLDER
        else:
            return
        self.publisher.withdraw(step, rank, holder)
        log.warning("step %d rank %d: corrupt copy in %s withdrawn (%s)", step, rank, tier, holder)

    def locate(self, step: int, rank: int) -> list[dict]:
        """Where shard (step, rank) can be read from, fastest first."""
        if self.prefetcher is not None:  # a prefetch of it under way: wait for it (bounded)
            self.prefetcher.join(step, rank)
        sources: list[dict] = []
        with self.lock:
            shard = self.memory.shards.get((step, rank))
            if shard is not None and shard.state == STAGED:  # saved a moment ago: checksums soon
                self.lock.wait_for(
                    lambda: shard.state != STAGED or Tier.MEMORY in shard.failed,
                    timeout=STAGED_WAIT_S,
                )
            if shard is not None and Tier.MEMORY in shard.tiers:
                shard.region.loaned = True  # the worker maps it: never write into it again
                sources.append(
                    {
                        "tier": Tier.MEMORY,
                        "node": self.node,
                        "path": str(shard.region.path),
                        "header": shard.header,
                    }
                )
            if shard is not None and Tier.PEER in shard.tiers and self.cfg.peer:
                sources.append({"tier": Tier.PEER, "node": self.cfg.peer, "addr": self.cfg.peer})
        for _, info in sorted(self.publisher.holders(step, rank).items()):
            if (
                info.get("tier") == Tier.MEMORY
                and info.get("node") != self.node
                and info.get("addr")
            ):
                sources.append({"tier": Tier.PEER, "node": info["node"], "addr": info["addr"]})
        listed = {s.get("addr") for s in sources}
        with self._holders_lock:
            said = list(self.peer_holders.get((step, rank), []))
        for node, addr in said:
            if addr not in listed:  # a peer that said it holds it, not (yet) in the catalog
                sources.append({"tier": Tier.PEER, "node": node, "addr": addr})
        if self.cfg.storage_dir is not None:
            path = storage.shard_path(self.cfg.storage_dir, step, rank)
            if path.exists():
                sources.append({"tier": Tier.STORAGE, "path": str(path)})
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
        peers = {
            str(info["node"]): info["addr"]
            for info in self.publisher.holders(floor, rank).values()
            if info.get("tier") == Tier.MEMORY
            and isinstance(info.get("node"), str)
            and isinstance(info.get("addr"), str)
            and info["addr"]
        }
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


def parse_timeout(value: Any) -> float | None:
    """A `wait` request's timeout: None (no limit) or seconds >= 0; ValueError else."""
    if value is None:
        return None
    if type(value) not in (int, float) or not 0 <= value < float("inf"):
        raise ValueError(f"timeout must be null or seconds >= 0, not {str(value)[:40]!r}")
    return float(value)
