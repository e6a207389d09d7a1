"""Checkpoint servers as real processes, with a real etcd: workers and servers killed for real."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import wait_for

from transom import checkpoint
from transom.checkpoint import catalog, storage
from transom.common import keys
from transom.common.records import Plan
from transom.common.states import JobState
from transom.store import EmbeddedEtcd, Store, StoreAccess
from transom.utils.procs import stop_process

pytestmark = pytest.mark.slow
SECRET = "test-secret"


class ServerProcess:
    """`python -m transom.checkpoint.server` for one simulated node."""

    def __init__(
        self,
        tmp: Path,
        node: str,
        job: str,
        store: StoreAccess | None = None,
        storage_dir: Path | None = None,
        memory: str = "1G",
    ):
        self.socket = str(tmp / f"{node}.sock")
        self.shm_dir = Path("/dev/shm") / f"transom-test-{job}-{node}"
        argv = [
            sys.executable,
            "-m",
            "transom.checkpoint.server",
            "--node-id",
            node,
            "--job-id",
            job,
            "--socket",
            self.socket,
            "--shm-dir",
            str(self.shm_dir),
            "--memory",
            memory,
            "--lease-ttl",
            "2",
        ]
        if store:
            argv += store.argv()
        if storage_dir:
            argv += ["--storage", str(storage_dir)]
        self.log = open(tmp / f"server-{node}-{uuid.uuid4().hex[:4]}.log", "w+")
        self.process = subprocess.Popen(
            argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TRANSOM_CKPT_SECRET": SECRET},
        )
        wait_for(
            lambda: self.process.poll() is not None or "ready" in Path(self.log.name).read_text(),
            30,
            f"checkpoint server {node} to start",
        )
        assert self.process.poll() is None, Path(self.log.name).read_text()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        stop_process(self.process)
        self.log.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)  # a killed server cannot clean up


@pytest.fixture
def servers(tmp_path):
    started: list[ServerProcess] = []

    def start(*args, **kwargs) -> ServerProcess:
        s = ServerProcess(tmp_path, *args, **kwargs)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


WORKER = textwrap.dedent("""
    import os, signal, sys, torch
    from transom import checkpoint
    torch.manual_seed(int(sys.argv[2]))
    model = {"w": torch.randn(256, 256), "b": torch.randn(256).to(torch.bfloat16)}
    state = {"model": model, "step": 3}
    engine = checkpoint.Engine(socket_path=sys.argv[1], rank=0, world_size=1)
    if sys.argv[3] == "save-and-die":
        engine.save(3, state)
        os.kill(os.getpid(), signal.SIGKILL)  # killed right after save() returned
    back = engine.load()
    ok = all(torch.equal(back["model"][k], model[k]) for k in model) and back["step"] == 3
    print("loaded", engine.last_load.tier, "exact" if ok else "DIFFERENT", flush=True)
""")


def run_worker(
    tmp_path: Path, socket_path: str, mode: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return subprocess.run(
        [sys.executable, str(script), socket_path, "7", mode],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TRANSOM_CKPT_SECRET": SECRET, **(env or {})},
    )


def test_worker_killed_right_after_save_resumes_from_memory(tmp_path, servers):
    server = servers("node0", "j1")
    died = run_worker(tmp_path, server.socket, "save-and-die")
    assert died.returncode == -signal.SIGKILL, died.stderr
    resumed = run_worker(tmp_path, server.socket, "load")
    assert resumed.returncode == 0, resumed.stderr
    assert "loaded memory exact" in resumed.stdout


def test_replacement_node_restores_from_the_peer_replica(tmp_path):
    with EmbeddedEtcd(tmp_path / "etcd") as etcd:
        job = "j" + uuid.uuid4().hex[:6]
        store = Store(etcd.access, job)
        plan = Plan(generation=1, members=["node0", "node1"], job_state=JobState.RUNNING)
        store.put(keys.PLAN, plan.to_dict())
        started = []
        try:
            a = ServerProcess(tmp_path, "node0", job, etcd.access)
            started.append(a)
            b = ServerProcess(tmp_path, "node1", job, etcd.access)
            started.append(b)
            engine = checkpoint.Engine(
                socket_path=a.socket, rank=0, world_size=1, secret=SECRET.encode()
            )
            torch.manual_seed(7)
            state = {
                "model": {"w": torch.randn(256, 256), "b": torch.randn(256).to(torch.bfloat16)},
                "step": 3,
            }
            wait_for(
                lambda: catalog.servers(store).keys() >= {"node0", "node1"},
                10,
                "both servers registered",
            )
            engine.save(3, state).wait("peer", timeout=60)
            engine.close()
            wait_for(  # listed in the background, with the next batch of writes
                lambda: set(catalog.holders(store, 3, 0)) == {"mem-node0", "mem-node1"},
                10,
                "both memory copies listed",
            )
            a.kill()  # the node dies: its memory and its etcd entries (lease) go
            wait_for(
                lambda: "mem-node0" not in catalog.holders(store, 3, 0),
                15,
                "node0's lease to expire",
            )
            assert (
                catalog.newest_restorable(store, world_size=1) == 3
            )  # the replica keeps step 3 restorable
            replacement = ServerProcess(tmp_path, "node2", job, etcd.access)
            started.append(replacement)
            resumed = run_worker(tmp_path, replacement.socket, "load")
            assert resumed.returncode == 0, resumed.stderr
            assert "loaded peer exact" in resumed.stdout
            events = [e for e in store.get_prefix("events/").values() if e["kind"] == "checkpoint"]
            assert any(e["action"] == "restored" and e.get("tier") == "peer" for e in events), (
                events
            )
        finally:
            for s in started:
                s.stop()


def test_server_killed_during_persistence_never_leaves_a_checkpoint_that_loads_wrong(
    tmp_path, servers
):
    """SIGKILL the server at random moments while it writes shards; every step that loads is
    exact."""
    root = tmp_path / "storage"
    rng = random.Random(5)
    expected = {}
    step = interrupted = 0
    for round_ in range(5):
        server = servers(f"node{round_}", "j3", storage_dir=root)
        engine = checkpoint.Engine(
            socket_path=server.socket, rank=0, world_size=1, storage_dir=root
        )
        for _ in range(3):
            step += 1
            expected[step] = torch.full((8 << 20,), float(step))  # 32 MiB: writes take a while
            engine.save(step, {"w": expected[step], "step": step})
        wait_for(
            lambda: list(root.glob("step_*/.*.tmp*")), 30, "a shard write to start", interval=0.002
        )
        time.sleep(rng.uniform(0.0, 0.05))  # somewhere inside the background writes
        server.kill()
        engine.close(wait=False)
        interrupted += step not in storage.complete_steps(root)
    assert interrupted >= 1, "no kill landed during persistence: the test proved nothing"
    # A server started after all those deaths still persists a step whole (and on a loaded machine
    # every kill may have landed before any step was complete: this one is certain to be).
    server = servers("node-last", "j3", storage_dir=root)
    with checkpoint.Engine(
        socket_path=server.socket, rank=0, world_size=1, storage_dir=root
    ) as engine:
        step += 1
        expected[step] = torch.full((8 << 20,), float(step))
        engine.save(step, {"w": expected[step], "step": step}).wait("storage")
    assert step in storage.complete_steps(root)
    loaded = 0
    for s in storage.complete_steps(root):
        header, data = storage.read_shard(storage.shard_path(root, s, 0), s, 0)
        state = checkpoint.layout.rebuild(header, data)
        assert state["step"] == s and torch.equal(state["w"], expected[s])
        loaded += 1
    for path in root.glob(
        "step_*/rank_*.shard"
    ):  # a shard file without a manifest is whole or rejected
        s = int(path.parent.name.split("_")[1])
        try:
            header, data = storage.read_shard(path, s, 0)
        except checkpoint.ShardError:
            continue
        assert torch.equal(checkpoint.layout.rebuild(header, data)["w"], expected[s])
    assert loaded >= 1
    with checkpoint.Engine(storage_dir=root) as engine:
        state = engine.load()
        assert torch.equal(state["w"], expected[state["step"]])


def test_a_server_that_dies_while_holding_a_region_reserved_ahead_costs_one_save(tmp_path, servers):
    """Saves every step have the next step's region reserved ahead (next_region.py); the server
    is SIGKILLed and its regions removed, as its successor does: the next save is refused (never
    an exception into training) and the one after reaches the new server."""
    old = servers("node0", "jra")
    engine = checkpoint.Engine(socket_path=old.socket, rank=0, world_size=1, secret=SECRET.encode())
    try:
        t = torch.zeros(4096)
        for step in (1, 2, 3):
            t.fill_(float(step))
            assert engine.save(step, {"t": t}, overlap=True).ok
        engine._copy.wait_finished()
        engine.connection.settle()  # the reply: step 4's region is reserved ahead now
        old.kill()
        shutil.rmtree(old.shm_dir, ignore_errors=True)
        servers("node0", "jra")  # the agent's new server, on the same socket
        t.fill_(4.0)
        refused = engine.save(4, {"t": t}, overlap=True)
        engine._copy.wait_finished()
        assert not refused.ok
        t.fill_(5.0)
        engine.save(5, {"t": t}, overlap=True).wait("memory", timeout=30)
        assert torch.equal(engine.load(step=5)["t"], torch.full((4096,), 5.0))
    finally:
        engine.close(wait=False)
