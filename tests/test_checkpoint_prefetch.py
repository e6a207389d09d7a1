"""Restore prefetch: a replacement node's server pulls its ranks' shards of the plan's restore step
from the peers holding them, so its workers load from local memory; one that does not fit the
budget is skipped and the workers load from the peer as before."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import shm_dir_for, torch_mapped, wait_for

from transom import checkpoint
from transom.checkpoint import catalog, prefetch
from transom.checkpoint.client import ServerConnection
from transom.checkpoint.publisher import PlanView
from transom.checkpoint.server import CheckpointServer
from transom.checkpoint.server_options import ServerConfig
from transom.checkpoint.worker_protocol import PrefetchStatus, ShardStatus, Status, StatusRequest
from transom.common import env, keys
from transom.common.records import Plan
from transom.common.states import JobState
from transom.store import EmbeddedEtcd, Store, StoreAccess
from transom.utils.procs import stop_process

SECRET = "prefetch-secret"
STEP = 3


def _state(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    return {"model": {"w": torch.randn(256, 256, generator=g)}, "rank": rank}


WORKER = textwrap.dedent("""
    import sys, torch
    from transom import checkpoint
    socket_path, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    g = torch.Generator().manual_seed(100 + rank)
    expected = torch.randn(256, 256, generator=g)
    engine = checkpoint.Engine(socket_path=socket_path, rank=rank, world_size=world)
    back = engine.load(STEP)
    ok = torch.equal(back["model"]["w"], expected) and back["rank"] == rank
    print("loaded", engine.last_load.tier, "exact" if ok else "DIFFERENT", flush=True)
""").replace("STEP", str(STEP))


class Server:
    """`python -m transom.checkpoint.server` for one simulated node with one rank."""

    def __init__(self, tmp: Path, node: str, job: str, store: StoreAccess, memory: str = "1G"):
        self.node = node
        self.socket = str(tmp / f"{node}.sock")
        self.shm_dir = Path("/dev/shm") / f"transom-test-{job}-{node}"
        argv = [sys.executable, "-m", "transom.checkpoint.server", "--node-id", node]
        argv += ["--job-id", job, "--socket", self.socket, "--shm-dir", str(self.shm_dir)]
        argv += ["--memory", memory, "--lease-ttl", "2", "--ranks-per-node", "1", *store.argv()]
        self.log_path = tmp / f"server-{node}.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, env.CKPT_SECRET: SECRET},
            )
        wait_for(
            lambda: self.process.poll() is not None or "ready" in self.log_path.read_text(),
            30,
            f"checkpoint server {node} to start",
        )
        assert self.process.poll() is None, self.log_path.read_text()

    def status(self) -> Status:
        connection = ServerConnection(self.socket)
        try:
            reply = connection.request(StatusRequest())
        finally:
            connection.close()
        assert isinstance(reply, Status), reply
        return reply

    def holds_in_memory(self, step: int, rank: int) -> ShardStatus | None:
        for shard in self.status().shards:
            if (shard.step, shard.rank) == (step, rank) and "memory" in shard.tiers:
                return shard
        return None

    def prefetch_outcome(self, step: int, rank: int) -> str | None:
        for entry in self.status().prefetch:
            if (entry.step, entry.rank) == (step, rank) and entry.outcome != "running":
                return entry.outcome
        return None

    def kill(self) -> None:
        stop_process(self.process, grace_s=0)

    def stop(self) -> None:
        stop_process(self.process)
        subprocess.run(["rm", "-rf", str(self.shm_dir)], check=False)


def _load(tmp_path: Path, server: Server, rank: int, world: int) -> str:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    done = subprocess.run(
        [sys.executable, str(script), server.socket, str(rank), str(world)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, env.CKPT_SECRET: SECRET},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _plan(store: Store, generation: int, members: list[str], restore_step: int | None) -> None:
    plan = Plan(generation, members, JobState.RUNNING, restore_step=restore_step)
    store.put(keys.PLAN, plan.to_dict())


@pytest.mark.slow
def test_a_replacement_server_prefetches_its_ranks_shards_before_its_workers_load(tmp_path):
    with EmbeddedEtcd(tmp_path / "etcd") as etcd:
        job = "p" + uuid.uuid4().hex[:6]
        store = Store(etcd.access, job)
        _plan(store, 1, ["node0", "node1"], None)
        started: list[Server] = []
        try:
            node0 = Server(tmp_path, "node0", job, etcd.access)
            started.append(node0)
            node1 = Server(tmp_path, "node1", job, etcd.access)
            started.append(node1)
            wait_for(
                lambda: catalog.servers(store).keys() >= {"node0", "node1"},
                10,
                "both servers registered",
            )
            for rank, server in enumerate((node0, node1)):  # each replicates to the other
                engine = checkpoint.Engine(
                    socket_path=server.socket, rank=rank, world_size=2, secret=SECRET.encode()
                )
                engine.save(STEP, _state(rank)).wait("peer", timeout=60)
                engine.close()
            wait_for(  # listed in the background, with the next batch of writes
                lambda: set(catalog.holders(store, STEP, 0)) == {"mem-node0", "mem-node1"},
                10,
                "both memory copies listed",
            )
            node0.kill()  # rank 0's node dies; node1 holds its replica
            wait_for(
                lambda: "mem-node0" not in catalog.holders(store, STEP, 0),
                15,
                "node0's lease to expire",
            )

            # A replacement whose budget cannot hold rank 0's shard: skipped, no error.
            small = Server(tmp_path, "node2", job, etcd.access, memory="64K")
            started.append(small)
            _plan(store, 2, ["node2", "node1"], STEP)
            wait_for(lambda: small.prefetch_outcome(STEP, 0), 20, "node2's prefetch to end")
            assert small.prefetch_outcome(STEP, 0) == prefetch.SKIPPED
            assert small.holds_in_memory(STEP, 0) is None
            assert small.process.poll() is None  # still serving
            assert "loaded peer exact" in _load(tmp_path, small, 0, 2)
            small.stop()
            started.remove(small)

            # A replacement with room: rank 0's shard is in its memory before any worker runs.
            spare = Server(tmp_path, "node3", job, etcd.access)
            started.append(spare)
            assert spare.holds_in_memory(STEP, 0) is None
            _plan(store, 3, ["node3", "node1"], STEP)
            held = wait_for(
                lambda: spare.holds_in_memory(STEP, 0), 20, "node3 to prefetch rank 0's shard"
            )
            assert held.origin == "node1", held
            assert node1.prefetch_outcome(STEP, 1) is None  # node1 holds its own rank already
            assert "loaded memory exact" in _load(tmp_path, spare, 0, 2)

            def node3_events() -> list[dict]:
                """Node3's checkpoint events of rank 0 (they go to etcd with the server's next
                batch of writes, up to store/batch_writer.py's spacing after the fact)."""
                return [
                    e
                    for e in store.get_prefix("events/").values()
                    if e["kind"] == "checkpoint" and e["node"] == "node3" and e.get("rank") == 0
                ]

            def node3_prefetched_and_restored_from_memory() -> bool:
                mine = node3_events()
                return any(e["action"] == "prefetched" for e in mine) and any(
                    e["action"] == "restored" and e["tier"] == "memory" for e in mine
                )

            wait_for(
                node3_prefetched_and_restored_from_memory,
                10,
                lambda: (
                    "node3's prefetched event and its restored event from memory; it sent: "
                    + ", ".join(f"{e['action']} ({e.get('tier')})" for e in node3_events())
                ),
            )
            for server in (node1, spare):  # pushed, received, served and prefetched shards
                assert torch_mapped(server.process.pid) == [], server.node
        finally:
            for s in started:
                s.stop()


def test_a_worker_waits_for_a_prefetch_under_way_at_most_the_bound(tmp_path, monkeypatch):
    """`locate` waits while a prefetch of its shard runs, returns as soon as it ends, and after
    PREFETCH_WAIT_S falls through to the other sources."""
    monkeypatch.setattr(prefetch, "PREFETCH_WAIT_S", 0.5)
    cfg = ServerConfig(
        node_id="n0",
        socket_path=tmp_path / "n0.sock",
        shm_dir=shm_dir_for(tmp_path, "-n0"),
        budget_bytes=1 << 26,
        replicas=0,
        ranks_per_node=1,
    )
    server = CheckpointServer(cfg).start()
    try:
        with server.memory.lock:
            server.prefetcher.in_flight.add((STEP, 0))
        t0 = time.monotonic()
        assert server.workers.locate(STEP, 0) == []  # nothing holds it: after the bound
        assert 0.5 <= time.monotonic() - t0 < 5
        ended = threading.Timer(
            0.1, lambda: server.prefetcher._finish(PrefetchStatus(STEP, 0, prefetch.FAILED))
        )
        with server.memory.lock:
            server.prefetcher.in_flight.add((STEP, 0))
        monkeypatch.setattr(prefetch, "PREFETCH_WAIT_S", 30.0)
        t0 = time.monotonic()
        ended.start()
        server.workers.locate(STEP, 0)
        assert time.monotonic() - t0 < 10  # released when the prefetch ended, not at 30 s
    finally:
        server.stop()


def test_a_nodes_ranks_follow_its_place_in_the_plan() -> None:
    def ranks(node: str, per_node: int, members: list[str]) -> list[int]:
        memory = SimpleNamespace(lock=threading.Condition())  # only its lock is used here
        fetcher = prefetch.Prefetcher(node, per_node, b"", memory, None, None)  # type: ignore[arg-type]
        return fetcher.ranks(PlanView(1, members, STEP))

    assert ranks("b", 2, ["a", "b", "c"]) == [2, 3]
    assert ranks("a", 1, ["a", "b"]) == [0]
    assert ranks("z", 2, ["a", "b"]) == []  # not a member: nothing to fetch
    assert ranks("b", 0, ["a", "b"]) == []  # ranks per node unknown: no prefetch
