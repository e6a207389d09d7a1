"""Every rank loads the same step, or none: a rank whose copy of the newest step is bad makes
every rank fall back together, with a process group and without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transom import checkpoint
from transom.checkpoint import storage
from transom.utils.net import free_port

STEPS = (8400, 8420, 8440)


def _save_world_of_two(root: Path) -> None:
    """Steps STEPS of a world of 2 in storage, each rank's value its step + rank."""
    engines = [checkpoint.Engine(storage_dir=root, rank=r, world_size=2) for r in (0, 1)]
    for step in STEPS:
        handles = [
            engine.save(step, {"w": torch.full((64,), float(step + rank))})
            for rank, engine in enumerate(engines)
        ]
        for handle in handles:
            handle.wait("storage", timeout=30)
    for engine in engines:
        engine.close()
    assert storage.complete_steps(root) == sorted(STEPS, reverse=True)


def _flip(path: Path, offset_from_end: int = 64, count: int = 16) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        chunk = bytearray(f.read(count))
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in chunk))


def test_without_a_process_group_every_rank_falls_back_together(tmp_path: Path) -> None:
    _save_world_of_two(tmp_path)
    _flip(storage.shard_path(tmp_path, 8440, 0))
    loaded = {}
    for rank in (0, 1):
        with checkpoint.Engine(storage_dir=tmp_path, rank=rank, world_size=2) as engine:
            state = engine.load()
            loaded[rank] = (engine.last_load.step, float(state["w"][0]))
    assert loaded == {0: (8420, 8420.0), 1: (8420, 8421.0)}


def test_without_a_process_group_no_good_step_is_one_error_on_every_rank(tmp_path: Path) -> None:
    _save_world_of_two(tmp_path)
    for step in STEPS:
        _flip(storage.shard_path(tmp_path, step, step % 2))  # a bad shard in every step
    for rank in (0, 1):
        with checkpoint.Engine(storage_dir=tmp_path, rank=rank, world_size=2) as engine:
            with pytest.raises(checkpoint.CheckpointError, match="no step could be loaded"):
                engine.load()


RANK_SCRIPT = """
import json, sys
import torch.distributed as dist
from transom import checkpoint
root, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
with checkpoint.Engine(storage_dir=root, rank=rank, world_size=2) as engine:
    try:
        state = engine.load()
        out = {"step": engine.last_load.step, "w": float(state["w"][0])}
    except checkpoint.CheckpointError as e:
        out = {"error": str(e)}
print(json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def _load_in_a_process_group(root: Path) -> dict[int, dict]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(root), str(rank), str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return {rank: json.loads(out.strip().splitlines()[-1]) for rank, out in enumerate(outs)}


@pytest.mark.integration  # two rank processes in a gloo group
def test_with_a_process_group_every_rank_falls_back_together(tmp_path: Path) -> None:
    _save_world_of_two(tmp_path)
    _flip(storage.shard_path(tmp_path, 8440, 1))
    # Rank 0 could read its own shard of 8440; rank 1 could not: both take 8420.
    assert _load_in_a_process_group(tmp_path) == {
        0: {"step": 8420, "w": 8420.0},
        1: {"step": 8420, "w": 8421.0},
    }
    for step in (8420, 8400):
        _flip(storage.shard_path(tmp_path, step, 0))
    results = _load_in_a_process_group(tmp_path)
    assert all(
        "no step could be loaded by every rank" in r.get("error", "") for r in results.values()
    )


SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def _job_store(job):
    from conftest import embedded_etcd, etcd_access

    from transom.store import Store

    return Store(etcd_access(embedded_etcd(job.run_dir), job.run_dir), job.job_id)


def _memory_copies(job, step: int, rank: int) -> list[str]:
    """The region files of `rank`'s shard of `step` in each node's server memory."""
    from transom.checkpoint.client import ServerConnection
    from transom.checkpoint.server_options import SOCKET_NAME
    from transom.checkpoint.shm_dirs import default_shm_dir
    from transom.checkpoint.worker_protocol import Locate, Located

    paths = []
    for node in ("node0", "node1"):
        conn = ServerConnection(str(default_shm_dir(job.job_id, node) / SOCKET_NAME))
        try:
            reply = conn.request(Locate(step, rank))
        finally:
            conn.close()
        assert isinstance(reply, Located), reply
        paths += [s.path for s in reply.sources if s.tier == "memory" and s.path]
    return paths


def _restore_step_in_both_memories(job, store, rank: int) -> tuple[int, list[str]] | None:
    """(the step the controller would restore now, the region files of `rank`'s shard of it
    in both nodes' memory: its own and the replica); None until both hold it."""
    from transom.checkpoint import catalog

    steps = catalog.restorable_steps(store, 2)
    if not steps:
        return None
    paths = _memory_copies(job, steps[0], rank)
    return (steps[0], paths) if len(paths) == 2 else None


def _flip_head(path: str) -> None:
    with open(path, "r+b") as f:
        head = f.read(16)
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in head))


@pytest.mark.slow
def test_under_a_controller_a_rank_with_no_good_copy_moves_every_rank_to_an_older_step_together(
    start_job, tmp_path: Path
) -> None:
    import signal

    from conftest import SMALL_GPT, wait_for

    store_dir = tmp_path / "store"
    job = start_job(
        "--nnodes", "2", "--ckpt-storage", store_dir, SCRIPT, *SMALL_GPT,
        "--ckpt-every", "10", "--steps", "300", "--step-delay", "0.05",
    )  # fmt: skip
    wait_for(lambda: len(storage.complete_steps(store_dir)) >= 2, 120, "two steps in storage")
    workers = [wait_for(lambda r=r: job.worker(r), 10, f"rank {r}") for r in (0, 1)]
    for w in workers:
        w.send_signal(signal.SIGSTOP)  # no save moves the newest step while its copies change
    try:
        store = _job_store(job)
        bad, regions = wait_for(
            lambda: _restore_step_in_both_memories(job, store, 0), 20, "the newest step settled"
        )
        for region in regions:
            _flip_head(region)
        if storage.shard_path(store_dir, bad, 0).exists():
            _flip(storage.shard_path(store_dir, bad, 0))
    finally:
        workers[1].send_signal(signal.SIGKILL)
        workers[0].send_signal(signal.SIGCONT)
    assert job.wait(240) == 0, job.output
    generations = [e for e in job.events() if e["kind"] == "generation"]
    assert generations[1]["restore_step"] == bad  # the catalog still listed it
    # Rank 0 finds no good copy of it; the ranks go on to an older step they all hold, together
    # (agreement.py): each rank's last restore of the generation is that step.
    last_restored: dict[int, int] = {}
    for e in sorted(job.events(), key=lambda e: e["time"]):
        if e.get("action") == "restored" and e["time"] > generations[1]["time"]:
            last_restored[e["rank"]] = e["step"]
    assert set(last_restored) == {0, 1} and len(set(last_restored.values())) == 1
    assert last_restored[0] < bad
    corrupt = [e for e in job.events() if e.get("action") == "bad-copy" and e.get("corrupt")]
    assert {e["tier"] for e in corrupt} >= {"memory", "peer"}
