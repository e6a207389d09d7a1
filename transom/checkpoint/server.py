"""The per-node checkpoint server: wires its memory, save pipeline, services and etcd side.

One server runs per node (the node agent starts it; `transom ckpt-server` or an `Engine` without a
launcher starts one on its own). It outlives the node's workers: a worker that crashes right
after a save is replaced by one that loads the shard from here.

A save goes: the worker asks to `reserve` a region of the shard's size (budget.py), copies its
tensors into it (shm.py), and `commit`s the header (worker_service.py); from then on the server
works alone, in the background (pipeline.py): checksums (the shard is then in the `memory` tier
and listed in etcd, publisher.py), a replica pushed to the ring peer's server (`peer`,
peer_port.py and peer_service.py on the other side), the file written to storage (`storage`).
Loads ask to `locate` a shard and get its sources, fastest first. When the plan names a restore
step, the server fetches its ranks' shards of it from peers ahead of its workers (prefetch.py).
This module only wires those parts and runs their threads; it must never grow request handling
or policy of its own.
"""

from __future__ import annotations

import functools
import logging
import signal
import socketserver
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from transom.checkpoint import agent_lease, capacity, catalog, server_options
from transom.checkpoint.budget import ShardMemory
from transom.checkpoint.peer_port import PeerPort
from transom.checkpoint.peer_service import PeerService
from transom.checkpoint.pipeline import SavePipeline
from transom.checkpoint.prefetch import Prefetcher
from transom.checkpoint.publisher import PlanView, Publisher
from transom.checkpoint.server_options import ServerConfig
from transom.checkpoint.shm import RegionDir
from transom.checkpoint.worker_service import WorkerService
from transom.common.states import Tier
from transom.store import Store, StoreError

log = logging.getLogger("transom.ckpt.server")
# How soon the worker socket's loop sees a stop (socketserver's default, 0.5 s, was a half-second
# wait in every embedded engine's close).
STOP_POLL_S = 0.05

SOCKET_PATH_MAX = 100


class CheckpointServer:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.node = cfg.node_id
        self.stopping = threading.Event()
        store = Store(access, cfg.job_id) if (access := cfg.store_access()) else None
        self.publisher = Publisher(
            store, cfg.node_id, cfg.lease_ttl_s if cfg.lease == "own" else None
        )
        self.publisher.withdraw_stale = bool(cfg.withdraw_stale)
        regions = RegionDir(cfg.shm_dir, cfg.job_id, cfg.node_id)
        self.budget = capacity.effective_budget(cfg.budget_bytes, cfg.shm_dir)
        self.memory = ShardMemory(
            regions,
            self.budget.nbytes,
            cfg.memory_keep,
            cfg.node_id,
            on_evict=self.publisher.unlist_memory,
            budget_source=self.budget.source,
        )
        self.publisher.held = lambda: self.memory.holding(Tier.MEMORY)
        self.publisher.on_plan = self._follow_plan
        self.publisher.on_discard = self._discard
        self.memory.discarded = self.publisher.discarded
        self.pipeline = SavePipeline(cfg, self.memory, self.publisher, self.stopping)
        self.prefetcher = Prefetcher(
            cfg.node_id, cfg.ranks_per_node, cfg.secret, self.memory, self.pipeline, self.publisher
        )
        self.workers = WorkerService(
            cfg, self.memory, self.pipeline, self.publisher, self.prefetcher
        )
        self.peers = PeerService(cfg.secret, self.memory, self.pipeline, self.publisher)
        self._unix: socketserver.ThreadingUnixStreamServer | None = None
        self._tcp: PeerPort | None = None
        self.addr = ""

    def _follow_plan(self, plan: PlanView) -> None:
        self.memory.protected_step = plan.restore_step
        self.prefetcher.follow(plan)

    def _discard(self, marks: list[catalog.Discard]) -> None:
        """Drop discarded steps (catalog.discards, already the publisher's) from this server's
        memory (a shard being read or checksummed goes when that ends; evicted ones leave the
        catalog), from storage, and the storage entries of the steps removed from the catalog
        (one listed after the controller's sweep, before this server knew, goes too)."""
        self.memory.drop_discarded()
        removed = self.pipeline.discard_stored(marks)
        if removed and self.publisher.store is not None:
            try:
                catalog.forget(self.publisher.store, marks, removed)
            except StoreError as e:
                log.warning("cannot withdraw discarded steps from the catalog: %s", e)

    def start(self) -> CheckpointServer:
        workers = self.workers

        class UnixHandler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                workers.serve(self.request)

        path = Path(self.cfg.socket_path)
        if len(str(path)) > SOCKET_PATH_MAX:
            raise ValueError(f"socket path {path} is too long for a Unix socket")
        path.unlink(missing_ok=True)
        socketserver.ThreadingUnixStreamServer.daemon_threads = True
        self._unix = socketserver.ThreadingUnixStreamServer(str(path), UnixHandler)
        if self.cfg.secret:  # peers authenticate with the secret: without one, no peer port
            self._tcp = PeerPort(
                self.cfg.host,
                self.cfg.port,
                self.cfg.secret,
                self.peers.serve,
                self.peers.auth_failed,
            )
            self.addr = f"{self.cfg.host}:{self._tcp.port}"
        self.publisher.start(self.addr)
        threads: list[tuple[Callable[[], None], str]] = [
            (functools.partial(self._unix.serve_forever, STOP_POLL_S), "ckpt-unix"),
            *self.pipeline.threads(),
        ]
        if self._tcp is not None:
            self._tcp.start()
        if self.publisher.store is not None:
            threads.append((lambda: self.publisher.follow(self.stopping), "ckpt-control"))
            if self.cfg.lease == "agent":
                # Unbuffered: a daemon thread blocked in a buffered stdin holds its lock, and the
                # interpreter's exit then aborted ("could not acquire lock ... at interpreter
                # shutdown", seen in demo and torture runs' server logs).
                pipe = open(sys.stdin.fileno(), "rb", buffering=0, closefd=False)
                agent_lease.follow(pipe, self.publisher.adopt)
        for target, name in threads:
            threading.Thread(target=target, name=name, daemon=True).start()
        log.info(
            "checkpoint server %s: socket %s, peers %s, budget %d bytes (set by %s)",
            self.node,
            path,
            self.addr or "-",
            self.memory.budget_bytes,
            self.budget.source,
        )
        return self

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every shard saved by this node's workers reached storage or failed to;
        False when `timeout_s` ran out first."""
        return self.pipeline.drain(timeout_s)

    def stop(self) -> None:
        self.stopping.set()
        if self._unix is not None:
            self._unix.shutdown()
            self._unix.server_close()
        if self._tcp is not None:
            self._tcp.close()
        self.pipeline.stop()
        Path(self.cfg.socket_path).unlink(missing_ok=True)
        self.publisher.stop()
        self.memory.release_all()


def main(argv: list[str] | None = None) -> int:
    """`transom ckpt-server` / `python -m transom.checkpoint.server` (its options:
    server_options.py)."""
    args = server_options.build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        cfg = server_options.from_args(args)
    except ValueError as e:
        print(f"transom ckpt-server: {e}", file=sys.stderr)
        return 2
    server = CheckpointServer(cfg)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    server.start()
    print(f"ready {server.cfg.socket_path} {server.addr}", flush=True)
    while not stop.wait(1.0):
        pass  # a timed wait: a signal delivered to another thread is handled within a second
    if server.cfg.storage_dir is not None and not server.drain(server_options.PERSIST_ON_STOP_S):
        log.warning(
            "stopping before every saved shard reached storage (%.0f s)",
            server_options.PERSIST_ON_STOP_S,
        )
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
