"""The per-node checkpoint server: holds shards in shared memory, replicates them, persists them.

One server runs per node (the node agent starts it; `transom ckpt-server` or an `Engine` without a
launcher starts one on its own). It outlives the node's workers: a worker that crashes right
after a save is replaced by one that loads the shard from here.

A save goes: the worker asks to `reserve` a region of the shard's size, copies its tensors into
it (shm.py), and `commit`s the header; from then on the server works alone, in the background:
checksums (the shard is then in the "memory" tier and listed in etcd), a replica pushed to the
ring peer's server ("replicated"), the file written to storage ("persisted"). Each tier reached
or failed is an event. Loads ask to `locate` a shard and get its sources, fastest first.

Memory: every region (own shards, peers' replicas, spare regions kept for reuse) counts against
a budget in bytes. A rank's newest complete shard and shards being saved or transferred are
never evicted; beyond those, the oldest go first, and beyond `memory_keep` steps per rank shards
are evicted after each save (their regions kept for the next save of the same size). A save
that cannot fit is refused with a reason; training goes on. The server never blocks a worker on
anything but the region hand-out, and never holds shard bytes outside shared memory.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import socket
import socketserver
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from transom.checkpoint import catalog, layout, replication, storage
from transom.checkpoint.protocol import AuthError, ProtocolError, authenticate, recv_msg, send_msg
from transom.checkpoint.shm import Region, RegionDir
from transom.checkpoint.shm_dirs import SHM_ROOT, default_shm_dir, sweep_stale_shm  # noqa: F401 - re-exported
from transom.store import Store, StoreError

log = logging.getLogger("transom.ckpt.server")

DEFAULT_MEMORY_KEEP = 2
DEFAULT_STORAGE_KEEP = 3
CONTROL_TICK_S = 1.0
REPLICATE_ATTEMPTS = 3
PERSIST_RETRY_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# Background work (checksums, replication, persistence) waits this long at most for saves in
# progress on this node to finish, so it does not compete with their copies for CPU and memory bandwidth.
QUIET_WAIT_S = 5.0
# A load of a shard whose checksums are still being computed waits this long for them.
STAGED_WAIT_S = 30.0
TIERS = ("memory", "replicated", "persisted")
SOCKET_PATH_MAX = 100


class BudgetExceeded(RuntimeError):
    """A save does not fit in the server's memory budget."""


@dataclass
class Shard:
    step: int
    rank: int
    world_size: int
    region: Region
    origin: str  # "local", or the node a replica came from
    state: str = "reserved"  # reserved -> staged -> committed
    header: dict | None = None
    header_bytes: bytes = b""
    tiers: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    pins: int = 0  # transfers reading the region right now
    staged_at: float = 0.0

    @property
    def key(self) -> tuple[int, int]:
        return self.step, self.rank


@dataclass
class ServerConfig:
    node_id: str
    socket_path: Path
    shm_dir: Path
    budget_bytes: int
    storage_dir: Path | None = None
    memory_keep: int = DEFAULT_MEMORY_KEEP
    storage_keep: int = DEFAULT_STORAGE_KEEP
    replicas: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    secret: bytes = b""
    store_url: str | None = None
    job_id: str | None = None
    lease_ttl_s: int = 4
    peer: str | None = None  # a fixed peer "host:port" for replicas, instead of the plan's ring


class CheckpointServer:
    def __init__(self, config: ServerConfig):
        self.cfg = config
        self.node = config.node_id
        self.lock = threading.Condition()
        self.shards: dict[tuple[int, int], Shard] = {}
        self.free: list[Region] = []
        self.used = 0
        self.preparing = 0  # spare regions being populated right now
        self.regions = RegionDir(config.shm_dir)
        self.store = Store(config.store_url, config.job_id) if config.store_url else None
        self.lease = None
        self.members: list[str] = []
        self.protected_step: int | None = None
        self.stopping = threading.Event()
        self.finalize_q: queue.Queue = queue.Queue()
        self.replicate_q: queue.Queue = queue.Queue()
        self.persist_q: queue.Queue = queue.Queue()
        self._unix: socketserver.ThreadingUnixStreamServer | None = None
        self._tcp: socketserver.ThreadingTCPServer | None = None
        self.addr = ""

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> CheckpointServer:
        server = self

        class UnixHandler(socketserver.BaseRequestHandler):
            def handle(self):
                server._serve_worker(self.request)

        class TcpHandler(socketserver.BaseRequestHandler):
            def handle(self):
                server._serve_peer(self.request)

        path = Path(self.cfg.socket_path)
        if len(str(path)) > SOCKET_PATH_MAX:
            raise ValueError(f"socket path {path} is too long for a Unix socket")
        path.unlink(missing_ok=True)
        socketserver.ThreadingUnixStreamServer.daemon_threads = True
        self._unix = socketserver.ThreadingUnixStreamServer(str(path), UnixHandler)
        if self.cfg.secret:  # peers authenticate with the secret: without one, no peer port
            socketserver.ThreadingTCPServer.allow_reuse_address = True
            socketserver.ThreadingTCPServer.daemon_threads = True
            self._tcp = socketserver.ThreadingTCPServer((self.cfg.host, self.cfg.port), TcpHandler)
            self.addr = f"{self.cfg.host}:{self._tcp.server_address[1]}"
        if self.store is not None:
            self.store.wait_healthy(10.0)
            self._new_lease()
        threads = [
            (self._unix.serve_forever, "ckpt-unix"),
            (self._finalizer, "ckpt-finalize"),
            (self._replicator, "ckpt-replicate"),
            (self._persister, "ckpt-persist"),
        ]
        if self._tcp is not None:
            threads.append((self._tcp.serve_forever, "ckpt-tcp"))
        if self.store is not None:
            threads.append((self._control, "ckpt-control"))
        for target, name in threads:
            threading.Thread(target=target, name=name, daemon=True).start()
        log.info(
            "checkpoint server %s: socket %s, peers %s, budget %d bytes",
            self.node,
            path,
            self.addr or "-",
            self.cfg.budget_bytes,
        )
        return self

    def stop(self) -> None:
        self.stopping.set()
        for srv in (self._unix, self._tcp):
            if srv is not None:
                srv.shutdown()
                srv.server_close()
        for q in (self.finalize_q, self.replicate_q, self.persist_q):
            q.put(None)
        Path(self.cfg.socket_path).unlink(missing_ok=True)
        if self.store is not None and self.lease is not None:
            try:
                self.store.revoke(self.lease)
            except StoreError:
                pass
        with self.lock:
            for shard in self.shards.values():
                shard.region.destroy()
            for region in self.free:
                region.destroy()
            self.shards.clear()
            self.free.clear()
        self.regions.remove()

    # -- etcd ------------------------------------------------------------------------------------
    def _new_lease(self) -> None:
        self.lease = self.store.lease(self.cfg.lease_ttl_s)
        if self.addr:
            self.store.put(
                f"{catalog.SERVERS}{self.node}",
                {"node": self.node, "addr": self.addr},
                lease=self.lease,
            )
        with self.lock:
            held = [s for s in self.shards.values() if "memory" in s.tiers]
        for shard in held:
            self._publish_memory(shard)

    def _publish_memory(self, shard: Shard) -> None:
        if self.store is None:
            return
        try:
            catalog.publish(
                self.store,
                shard.step,
                shard.rank,
                f"mem-{self.node}",
                {
                    "world_size": shard.world_size,
                    "node": self.node,
                    "tier": "memory",
                    "addr": self.addr,
                    "nbytes": shard.region.nbytes,
                    "origin": shard.origin,
                },
                lease=self.lease,
            )
        except StoreError as e:
            log.warning("cannot list step %d rank %d in etcd: %s", shard.step, shard.rank, e)

    def _withdraw(self, shard: Shard, holder: str) -> None:
        if self.store is None:
            return
        try:
            catalog.withdraw(self.store, shard.step, shard.rank, holder)
        except StoreError:
            pass

    def _control(self) -> None:
        """Keep the lease, follow the plan's members (for the ring peer) and its restore step."""
        while not self.stopping.wait(CONTROL_TICK_S / (1 if self.cfg.lease_ttl_s > 3 else 2)):
            try:
                if not self.store.refresh(self.lease):
                    self._new_lease()
                plan = self.store.get("plan") or {}
                self.members = list(plan.get("members", []))
                self.protected_step = plan.get("restore_step")
            except StoreError as e:
                log.debug("control tick: %s", e)

    def event(self, action: str, message: str, **fields) -> None:
        """A `checkpoint` event: into etcd's event log when there is one, and into the log."""
        log.info("%s", message)
        if self.store is None:
            return
        now = time.time()
        value = {
            "time": now,
            "kind": "checkpoint",
            "action": action,
            "message": message,
            "node": self.node,
            **fields,
        }
        try:
            self.store.put(
                f"events/{int(now * 1e9):020d}-ckpt-{self.node}-{threading.get_ident() % 10000}",
                value,
            )
        except StoreError:
            pass

    # -- memory ----------------------------------------------------------------------------------
    def reserve(
        self, step: int, rank: int, nbytes: int, world_size: int, origin: str = "local"
    ) -> Region:
        """A region for shard (step, rank), recycled or new; BudgetExceeded when it cannot fit."""
        with self.lock:
            old = self.shards.get((step, rank))
            if old is not None:
                if old.state != "committed" or old.pins:
                    raise BudgetExceeded(
                        f"step {step} rank {rank} is being saved or transferred already"
                    )
                self._evict(old)
            region = self._take_free(nbytes, rank)
            if (
                region is None and self.preparing
            ):  # a spare is being populated: it is the region to use
                self.lock.wait_for(lambda: not self.preparing, timeout=QUIET_WAIT_S)
                region = self._take_free(nbytes, rank)
            if region is None:
                reclaimable = sum(r.nbytes for r in self.free) + sum(
                    s.region.nbytes for s in self._victims()
                )
                if (
                    self.used - reclaimable + nbytes > self.cfg.budget_bytes
                ):  # refuse before evicting anything
                    held = sorted({s.step for s in self.shards.values()})
                    raise BudgetExceeded(
                        f"save of step {step} rank {rank} ({nbytes} bytes) does not fit the checkpoint memory "
                        f"budget of {self.cfg.budget_bytes} bytes on node {self.node} ({self.used} in use, "
                        f"holding steps {held}); raise --ckpt-memory"
                    )
                while region is None and self.used + nbytes > self.cfg.budget_bytes:
                    victims = self._victims()
                    if victims:
                        self._evict(victims[0])
                        region = self._take_free(nbytes, rank)
                    else:
                        self._destroy(self.free.pop(0))
            if region is not None:
                self.shards[(step, rank)] = Shard(step, rank, world_size, region, origin)
                return region
            self.used += nbytes
        try:
            region = self.regions.new(nbytes)  # slow (page population): outside the lock
        except OSError as e:
            with self.lock:
                self.used -= nbytes
            raise BudgetExceeded(
                f"cannot create a shared-memory region of {nbytes} bytes: {e}"
            ) from e
        with self.lock:
            self.shards[(step, rank)] = Shard(step, rank, world_size, region, origin)
        return region

    def _take_free(self, nbytes: int, rank: int) -> Region | None:
        """A free region of exactly `nbytes`, the one prepared for `rank` first (its worker mapped it)."""
        fits = [i for i, r in enumerate(self.free) if r.nbytes == nbytes]
        mine = [i for i in fits if self.free[i].prepared_for == rank]
        if not fits:
            return None
        region = self.free.pop((mine or fits)[0])
        region.prepared_for = None
        return region

    def _victims(self) -> list[Shard]:
        """Shards that may go, oldest first: complete, idle, not their rank's newest, not the restore step."""
        newest: dict[int, int] = {}
        for s in self.shards.values():
            if s.state == "committed":
                newest[s.rank] = max(newest.get(s.rank, -1), s.step)
        candidates = [
            s
            for s in self.shards.values()
            if s.state == "committed"
            and not s.pins
            and s.step != newest[s.rank]
            and s.step != self.protected_step
        ]
        return sorted(candidates, key=lambda s: s.step)

    def _evict(self, shard: Shard) -> None:
        """Drop a shard (lock held); its region goes to the free pool unless a worker loaded from it."""
        del self.shards[shard.key]
        if "memory" in shard.tiers:
            threading.Thread(
                target=self._withdraw, args=(shard, f"mem-{self.node}"), daemon=True
            ).start()
        shard.tiers.discard("memory")
        if shard.region.loaned:
            self._destroy(shard.region)
        else:
            self.free.append(shard.region)
        self.lock.notify_all()

    def _destroy(self, region: Region) -> None:
        self.used -= region.nbytes
        region.destroy()

    def _abort(self, step: int, rank: int, region: Region) -> None:
        with self.lock:
            shard = self.shards.get((step, rank))
            if shard is not None and shard.region is region and shard.state == "reserved":
                del self.shards[(step, rank)]
                self.free.append(region)
                self.lock.notify_all()

    def _retain(self, rank: int) -> None:
        """Evict this rank's complete shards beyond the `memory_keep` newest (lock held)."""
        mine = sorted(
            (s for s in self.shards.values() if s.rank == rank and s.state == "committed"),
            key=lambda s: s.step,
            reverse=True,
        )
        for s in mine[self.cfg.memory_keep :]:
            if not s.pins and s.step != self.protected_step:
                self._evict(s)

    def _prepare_spare(self, nbytes: int, rank: int) -> Region | None:
        """Make a populated region of `nbytes` ready for `rank`'s next save if the budget has room."""
        with self.lock:
            spare = next(
                (r for r in self.free if r.nbytes == nbytes and r.prepared_for in (rank, None)),
                None,
            )
            if spare is not None:
                spare.prepared_for = rank
                return spare
            if self.used + nbytes > self.cfg.budget_bytes:
                return None
            self.used += nbytes
            self.preparing += 1
        region = None
        try:
            region = self.regions.new(nbytes)
        except OSError:
            pass
        with self.lock:
            self.preparing -= 1
            if region is None:
                self.used -= nbytes
            else:
                region.prepared_for = rank
                self.free.append(region)
            self.lock.notify_all()
        return region

    # -- the save pipeline -----------------------------------------------------------------------
    def commit(self, step: int, rank: int, region: Region, header: dict) -> None:
        """The worker finished copying: checksums and the rest happen in the background."""
        with self.lock:
            shard = self.shards.get((step, rank))
            if shard is None or shard.region is not region or shard.state != "reserved":
                raise layout.ShardError(
                    f"step {step} rank {rank} was not reserved by this connection"
                )
            shard.header = header
            shard.state = "staged"
            shard.staged_at = time.time()
            self.lock.notify_all()
        self.finalize_q.put(shard)

    def _quiet(self) -> None:
        """Wait until no worker of this node is copying a save (at most QUIET_WAIT_S)."""
        with self.lock:
            self.lock.wait_for(
                lambda: not any(s.state == "reserved" for s in self.shards.values()),
                timeout=QUIET_WAIT_S,
            )

    def _finalizer(self) -> None:
        while (shard := self.finalize_q.get()) is not None:
            self._quiet()
            try:
                data = shard.region.view()[: shard.header["data_len"]]
                shard.header["chunks"] = layout.checksum_data(data)
                del data
                shard.header_bytes = layout.encode_header(shard.header)
            except Exception as e:  # noqa: BLE001 - a broken header: the shard is not usable
                self._fail(shard, "memory", f"cannot finalize: {e}")
                with self.lock:
                    if self.shards.get(shard.key) is shard:
                        self._evict(shard)
                continue
            self._committed(shard)
            self.event(
                "saved",
                f"step {shard.step} rank {shard.rank} saved in memory on {self.node} "
                f"({shard.region.nbytes} bytes)",
                step=shard.step,
                rank=shard.rank,
                tier="memory",
                staged=shard.staged_at,
            )
            if self.cfg.replicas > 0:
                self.replicate_q.put(shard)
            else:
                self._fail(shard, "replicated", "replication is off (replicas=0)")
            if self.cfg.storage_dir is not None:
                self.persist_q.put(shard)
            else:
                self._fail(shard, "persisted", "no storage directory configured")
            self._prepare_spare(shard.region.nbytes, shard.rank)

    def _committed(self, shard: Shard) -> None:
        with self.lock:
            shard.state = "committed"
            shard.tiers.add("memory")
            self._retain(shard.rank)
            self.lock.notify_all()
        self._publish_memory(shard)

    def _reached(self, shard: Shard, tier: str) -> None:
        with self.lock:
            shard.tiers.add(tier)
            self.lock.notify_all()

    def _fail(self, shard: Shard, tier: str, reason: str) -> None:
        with self.lock:
            shard.failed[tier] = reason
            self.lock.notify_all()

    def _pin(self, shard: Shard) -> bool:
        with self.lock:
            if self.shards.get(shard.key) is not shard:
                return False
            shard.pins += 1
            return True

    def _unpin(self, shard: Shard) -> None:
        with self.lock:
            shard.pins -= 1
            self.lock.notify_all()

    def _peer_addr(self) -> tuple[str | None, str]:
        """(peer address, its node) for this node's replicas, per the ring of the plan's members."""
        if self.cfg.peer:
            return self.cfg.peer, self.cfg.peer
        peer = replication.ring_peer(self.members, self.node)
        if peer is None or self.store is None:
            return None, "no peer node (a single node, or this node is not a member)"
        info = self.store.get(f"{catalog.SERVERS}{peer}")
        if not info:
            return None, f"peer {peer}'s checkpoint server is not registered"
        return info["addr"], peer

    def _replicator(self) -> None:
        while (shard := self.replicate_q.get()) is not None:
            self._quiet()
            if not self._pin(shard):
                self._fail(shard, "replicated", "evicted before it was replicated")
                continue
            try:
                error = None
                for attempt in range(REPLICATE_ATTEMPTS):
                    try:
                        addr, peer = self._peer_addr()
                        if addr is None:
                            error = peer
                            break
                        t0 = time.time()
                        replication.push(
                            addr,
                            self.cfg.secret,
                            shard.header,
                            shard.header_bytes,
                            shard.region.path,
                            self.node,
                        )
                        self._reached(shard, "replicated")
                        self.event(
                            "replicated",
                            f"step {shard.step} rank {shard.rank} replicated to {peer}",
                            step=shard.step,
                            rank=shard.rank,
                            tier="replicated",
                            peer=peer,
                            duration_s=time.time() - t0,
                        )
                        error = None
                        break
                    except (replication.ReplicationError, StoreError) as e:
                        error = str(e)
                        time.sleep(0.2 * (attempt + 1))
                if error is not None:
                    self._fail(shard, "replicated", error)
                    if "no peer" not in error:
                        self.event(
                            "failed",
                            f"step {shard.step} rank {shard.rank} not replicated: {error}",
                            step=shard.step,
                            rank=shard.rank,
                            tier="replicated",
                            error=error,
                        )
            finally:
                self._unpin(shard)

    def _persister(self) -> None:
        while (shard := self.persist_q.get()) is not None:
            with self.lock:
                newer = any(
                    s.rank == shard.rank
                    and s.step > shard.step
                    and s.origin == "local"
                    and s.state != "reserved"
                    for s in self.shards.values()
                )
            if newer and not self.persist_q.empty():
                self._fail(
                    shard, "persisted", "skipped: storage is behind and a newer step is queued"
                )
                continue
            self._quiet()
            if not self._pin(shard):
                self._fail(shard, "persisted", "evicted before it was persisted")
                continue
            try:
                self._persist(shard)
            finally:
                self._unpin(shard)

    def _persist(self, shard: Shard) -> None:
        root = Path(self.cfg.storage_dir)
        for attempt, delay in enumerate((0.0, *PERSIST_RETRY_S)):
            if self.stopping.wait(delay):
                return
            try:
                t0 = time.time()
                root.mkdir(parents=True, exist_ok=True)
                data = shard.region.view()[: shard.header["data_len"]]
                path = storage.write_shard(root, shard.step, shard.rank, shard.header_bytes, data)
                del data
                removed = storage.complete_step(
                    root, shard.step, shard.world_size, self.cfg.storage_keep
                )
            except OSError as e:
                retry = attempt < len(PERSIST_RETRY_S)
                self.event(
                    "failed",
                    f"step {shard.step} rank {shard.rank} not persisted to {root}: "
                    f"{e.strerror or e}{'; retrying' if retry else '; giving up'}",
                    step=shard.step,
                    rank=shard.rank,
                    tier="persisted",
                    error=str(e),
                )
                continue
            if self.store is not None:
                try:
                    catalog.publish(
                        self.store,
                        shard.step,
                        shard.rank,
                        "storage",
                        {
                            "world_size": shard.world_size,
                            "node": self.node,
                            "tier": "storage",
                            "path": str(path),
                            "nbytes": shard.region.nbytes,
                        },
                    )
                    for step in removed:
                        catalog.withdraw_storage(self.store, step)
                except StoreError as e:
                    log.warning("cannot list a persisted shard in etcd: %s", e)
            self._reached(shard, "persisted")
            self.event(
                "persisted",
                f"step {shard.step} rank {shard.rank} persisted to {path}",
                step=shard.step,
                rank=shard.rank,
                tier="persisted",
                duration_s=time.time() - t0,
            )
            return
        self._fail(shard, "persisted", f"storage {root} not writable")

    # -- requests from workers -------------------------------------------------------------------
    def _serve_worker(self, sock: socket.socket) -> None:
        reserved: dict[tuple[int, int], Region] = {}
        try:
            while True:
                try:
                    msg = recv_msg(sock)
                except (ProtocolError, OSError):
                    return
                try:
                    reply = self._handle(msg, reserved)
                except (BudgetExceeded, layout.ShardError, KeyError, ValueError, TypeError) as e:
                    reply = {"ok": False, "error": str(e), "refused": isinstance(e, BudgetExceeded)}
                send_msg(sock, reply)
        finally:
            for (step, rank), region in reserved.items():
                self._abort(step, rank, region)

    def _handle(self, msg: dict, reserved: dict) -> dict:
        op = msg.get("op")
        if op == "reserve":
            step, rank = int(msg["step"]), int(msg["rank"])
            region = self.reserve(step, rank, int(msg["nbytes"]), int(msg["world_size"]))
            reserved[(step, rank)] = region
            return {"ok": True, "path": str(region.path), "nbytes": region.nbytes}
        if op == "commit":
            step, rank = int(msg["step"]), int(msg["rank"])
            region = reserved.pop((step, rank))
            self.commit(step, rank, region, msg["header"])
            return {"ok": True}
        if op == "abort":
            step, rank = int(msg["step"]), int(msg["rank"])
            region = reserved.pop((step, rank), None)
            if region is not None:
                self._abort(step, rank, region)
            return {"ok": True}
        if op == "wait":
            return self._wait(int(msg["step"]), int(msg["rank"]), msg["tier"], msg.get("timeout"))
        if op == "locate":
            return {"ok": True, "sources": self._locate(int(msg["step"]), int(msg["rank"]))}
        if op == "prepare":
            nbytes = int(msg["nbytes"])
            spare = self._prepare_spare(nbytes, int(msg.get("rank", 0)))
            return {"ok": spare is not None, "path": spare and str(spare.path), "nbytes": nbytes}
        if op == "steps":
            return {"ok": True, "steps": self._steps(int(msg["world_size"]))}
        if op == "event":
            self.event(
                msg.get("action", "restored"), msg.get("message", ""), **msg.get("fields", {})
            )
            return {"ok": True}
        if op == "status":
            with self.lock:
                return {
                    "ok": True,
                    "node": self.node,
                    "used": self.used,
                    "budget": self.cfg.budget_bytes,
                    "addr": self.addr,
                    "free": [r.nbytes for r in self.free],
                    "shards": [
                        {
                            "step": s.step,
                            "rank": s.rank,
                            "state": s.state,
                            "tiers": sorted(s.tiers),
                            "origin": s.origin,
                            "failed": s.failed,
                        }
                        for s in self.shards.values()
                    ],
                }
        raise ValueError(f"unknown request {op!r}")

    def _wait(self, step: int, rank: int, tier: str, timeout: float | None) -> dict:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}: one of {', '.join(TIERS)}")
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        with self.lock:
            while True:
                shard = self.shards.get((step, rank))
                if shard is None:
                    return {
                        "ok": False,
                        "error": f"step {step} rank {rank} is not held by this server",
                    }
                if tier in shard.tiers:
                    return {"ok": True, "tiers": sorted(shard.tiers)}
                if tier in shard.failed:
                    return {"ok": False, "error": shard.failed[tier]}
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return {
                        "ok": False,
                        "timeout": True,
                        "error": f"{tier} not reached within {timeout} s",
                    }
                self.lock.wait(left if left is not None else 1.0)

    def _locate(self, step: int, rank: int) -> list[dict]:
        """Where shard (step, rank) can be read from, fastest first."""
        sources = []
        with self.lock:
            shard = self.shards.get((step, rank))
            if (
                shard is not None and shard.state == "staged"
            ):  # saved a moment ago: checksums are coming
                self.lock.wait_for(
                    lambda: shard.state != "staged" or "memory" in shard.failed,
                    timeout=STAGED_WAIT_S,
                )
            if shard is not None and "memory" in shard.tiers:
                shard.region.loaned = True  # the worker maps it: never write into it again
                sources.append(
                    {
                        "tier": "memory",
                        "node": self.node,
                        "path": str(shard.region.path),
                        "header": shard.header,
                    }
                )
            if shard is not None and "replicated" in shard.tiers and self.cfg.peer:
                sources.append({"tier": "peer", "node": self.cfg.peer, "addr": self.cfg.peer})
        if self.store is not None:
            try:
                for holder, info in sorted(catalog.holders(self.store, step, rank).items()):
                    if (
                        info.get("tier") == "memory"
                        and info.get("node") != self.node
                        and info.get("addr")
                    ):
                        sources.append({"tier": "peer", "node": info["node"], "addr": info["addr"]})
            except StoreError as e:
                log.warning("cannot read the catalog: %s", e)
        if (
            self.cfg.storage_dir is not None
            and storage.shard_path(self.cfg.storage_dir, step, rank).exists()
        ):
            sources.append(
                {
                    "tier": "storage",
                    "path": str(storage.shard_path(self.cfg.storage_dir, step, rank)),
                }
            )
        return sources

    def _steps(self, world_size: int) -> list[int]:
        """Steps restorable for every rank of a world of `world_size`, newest first."""
        if self.store is not None:
            try:
                return catalog.restorable_steps(self.store, world_size)
            except StoreError as e:
                log.warning("cannot read the catalog, using local tiers only: %s", e)
        with self.lock:
            by_step: dict[int, set[int]] = {}
            for s in self.shards.values():
                if "memory" in s.tiers and s.world_size == world_size:
                    by_step.setdefault(s.step, set()).add(s.rank)
        steps = {s for s, ranks in by_step.items() if ranks == set(range(world_size))}
        if self.cfg.storage_dir is not None:
            for s in storage.complete_steps(self.cfg.storage_dir):
                manifest = storage.read_manifest(self.cfg.storage_dir, s)
                if manifest and manifest.get("world_size") == world_size:
                    steps.add(s)
        return sorted(steps, reverse=True)

    # -- requests from peers ---------------------------------------------------------------------
    def _serve_peer(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(replication.TRANSFER_TIMEOUT_S)
            authenticate(sock, self.cfg.secret, initiator=False)
        except AuthError as e:
            self.event("auth", f"rejected a peer connection from {sock.getpeername()[0]}: {e}")
            return
        except (ProtocolError, OSError):
            return
        try:
            msg = recv_msg(sock)
            if msg.get("op") == "put":
                origin = str(msg.get("origin", "peer"))

                def reserve(step, rank, nbytes):
                    return self.reserve(step, rank, nbytes, world_size=-1, origin=origin)

                def commit(region, header):
                    step, rank = int(msg["step"]), int(msg["rank"])
                    if header is None:
                        self._abort(step, rank, region)
                        return
                    with self.lock:
                        shard = self.shards[(step, rank)]
                        shard.header, shard.world_size = header, header["world_size"]
                        shard.header_bytes = layout.encode_header(header)
                    self._committed(shard)

                try:
                    replication.receive_put(sock, msg, reserve, commit)
                except (BudgetExceeded, layout.ShardError) as e:
                    send_msg(sock, {"ok": False, "error": str(e)})
            elif msg.get("op") == "get":
                step, rank = int(msg["step"]), int(msg["rank"])
                with self.lock:
                    shard = self.shards.get((step, rank))
                    ok = shard is not None and "memory" in shard.tiers
                    if ok:
                        shard.pins += 1
                if not ok:
                    send_msg(sock, {"ok": False, "error": "not held here"})
                    return
                try:
                    replication.serve_get(
                        sock, shard.header_bytes, shard.region.path, shard.header["data_len"]
                    )
                finally:
                    self._unpin(shard)
            else:
                send_msg(sock, {"ok": False, "error": f"unknown request {msg.get('op')!r}"})
        except (ProtocolError, OSError, KeyError, ValueError) as e:
            log.warning("peer request failed: %s", e)


# -- `python -m transom.checkpoint.server` ------------------------------------------------------


def default_budget() -> int:
    """Half of this machine's memory."""
    import psutil

    return psutil.virtual_memory().total // 2


def parse_size(text: str) -> int:
    """'8G', '512MiB', '1.5g', '1000000' -> bytes."""
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = str(text).strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in units and t[-1:] else ""
    number = t[:-1] if unit else t
    try:
        value = int(float(number) * units[unit])
    except ValueError as e:
        raise ValueError(f"{text!r} is not a size (examples: 8G, 512M, 1073741824)") from e
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="transom ckpt-server",
        description="Run a node's checkpoint server (the node agent starts one per node).",
    )
    p.add_argument("--node-id", default=socket.gethostname(), help="this node's name")
    p.add_argument(
        "--socket", type=Path, help="Unix socket for this node's workers (default: in --shm-dir)"
    )
    p.add_argument(
        "--shm-dir",
        type=Path,
        help="folder for shared-memory regions (default /dev/shm/transom-JOB-NODE)",
    )
    p.add_argument(
        "--memory",
        default=None,
        help="memory budget, e.g. 16G (default: half of this machine's memory)",
    )
    p.add_argument(
        "--storage", type=Path, help="storage directory for persisted shards (default: none)"
    )
    p.add_argument(
        "--keep", type=int, default=DEFAULT_STORAGE_KEEP, help="complete steps kept in storage"
    )
    p.add_argument(
        "--memory-keep", type=int, default=DEFAULT_MEMORY_KEEP, help="steps per rank kept in memory"
    )
    p.add_argument(
        "--replicas", type=int, default=1, choices=(0, 1), help="replicas in peer memory (0 or 1)"
    )
    p.add_argument("--store", help="etcd URL of the job (catalog, peers, events)")
    p.add_argument("--job-id", default="local", help="job name in etcd")
    p.add_argument("--host", default="127.0.0.1", help="address peers reach this server at")
    p.add_argument(
        "--port", type=int, default=0, help="TCP port for peers (default: any free port)"
    )
    p.add_argument(
        "--peer",
        metavar="HOST:PORT",
        help="send replicas to this server (default with --store: the "
        "next node in the plan's ring)",
    )
    p.add_argument(
        "--lease-ttl", type=int, default=4, help="seconds this server's etcd entries outlive it"
    )
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        budget = parse_size(args.memory) if args.memory else default_budget()
    except ValueError as e:
        print(f"transom ckpt-server: --memory {e}", file=sys.stderr)
        return 2
    shm_dir = args.shm_dir or default_shm_dir(args.job_id, args.node_id)
    secret = os.environ.get("TRANSOM_CKPT_SECRET", "").encode()
    if (args.store or args.peer) and not secret:
        print(
            "transom ckpt-server: TRANSOM_CKPT_SECRET must be set with --store or --peer (peers authenticate "
            "with it)",
            file=sys.stderr,
        )
        return 2
    server = CheckpointServer(
        ServerConfig(
            node_id=args.node_id,
            socket_path=args.socket or shm_dir / "server.sock",
            shm_dir=shm_dir,
            budget_bytes=budget,
            storage_dir=args.storage,
            memory_keep=args.memory_keep,
            storage_keep=args.keep,
            replicas=args.replicas if (args.store or args.peer) else 0,
            host=args.host,
            port=args.port,
            secret=secret,
            store_url=args.store,
            job_id=args.job_id,
            lease_ttl_s=args.lease_ttl,
            peer=args.peer,
        )
    )
    stop = threading.Event()
    import signal

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    server.start()
    print(f"ready {server.cfg.socket_path} {server.addr}", flush=True)
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
