"""End-to-end: `transom run` with examples/train_gpt.py on the checkpoint engine, real kills."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from conftest import SMALL_GPT, job_processes, wait_for

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
SMALL = [
    *SMALL_GPT,
    "--ckpt-every",
    "3",
    "--log-every",
    "1",
    "--steps",
    "30",
    "--step-delay",
    "0.15",
]


def restored(job, generation: int) -> dict[int, tuple[int, str]]:
    """rank -> (step, tier) from the `restored` lines of one generation's logs."""
    out = {}
    for m in re.finditer(
        r"\[train_gpt\] restored step=(\d+) rank=(\d+) tier=(\w+)",
        job.log_text(f"g{generation:03d}/rank*.log"),
    ):
        out[int(m.group(2))] = (int(m.group(1)), m.group(3))
    return out


def logged_step(job) -> int:
    """The newest step rank 0 logged in generation 1 (train_gpt with --log-every 1)."""
    steps = re.findall(r"^step (\d+) ", job.log_text("g001/rank0.log"), re.M)
    return max(map(int, steps), default=0)


def saved_step(job) -> int:
    """The newest step that any rank has in memory, per the checkpoint events."""
    return max(newest_saved(job).values(), default=0)


def newest_saved(job, before: float = float("inf")) -> dict[int, int]:
    """rank -> the newest step it saved in memory (events timed before `before`)."""
    out: dict[int, int] = {}
    for e in job.events():
        if e["kind"] == "checkpoint" and e.get("action") == "saved" and e["time"] < before:
            out[e["rank"]] = max(out.get(e["rank"], 0), e["step"])
    return out


@pytest.mark.parametrize("persist_every", ["0", "1000"])
def test_killed_worker_resumes_from_node_memory(start_job, persist_every):
    # Saves 1.5 s apart: the kill comes once both ranks' newest saved step is the same. Their
    # servers list it in etcd in the same batch as the event (store/batch_writer.py: 0.2 s after
    # a save when saves are more than its 1 s spacing apart), so that step is the restore step
    # and in both nodes' memory, unless the next save began meanwhile (below). With
    # --persist-every 1000 only the run's last checkpoint is written to storage. 60 steps: the
    # events that show step 20 saved may come a few seconds late, and a worker that finished
    # exits at once.
    job = start_job(
        "--nnodes", "2", SCRIPT, *SMALL, "--ckpt-every", "10", "--steps", "60",
        "--persist-every", persist_every,
    )  # fmt: skip
    # Saves that are not persisted write no event: with --persist-every 1000 rank 0's log says
    # when the ranks (in step through their all-reduce) are past the save of step 20.
    wait_for(
        lambda: (
            logged_step(job) >= 25
            if persist_every != "0"
            else (saved := newest_saved(job)).keys() == {0, 1} and saved[0] == saved[1] >= 20
        ),
        90,
        "two checkpoints of both ranks in memory",
    )
    victim = wait_for(lambda: job.worker(1), 10, "the rank 1 worker")
    victim.send_signal(signal.SIGKILL)
    assert job.wait() == 0, job.output
    generation = next(e for e in job.events() if e["kind"] == "generation" and e["generation"] == 2)
    step = generation["restore_step"]
    assert step is not None and step >= 20
    ranks = restored(job, 2)
    assert set(ranks) == {0, 1}
    # Memory keeps one step a rank: a rank that saved a step newer than the restore step (the
    # next save, finished by one rank but not the other when the kill came) has the restore step
    # only in storage, or, when that newer step is memory-only, in memory still (memory keeps
    # the step before it). Every other rank reads its own node's memory.
    newest = newest_saved(job, before=generation["time"])
    for rank in (0, 1):
        tier = "memory" if persist_every != "0" or newest[rank] == step else "storage"
        assert ranks[rank] == (step, tier), (rank, newest)
    assert f"[train_gpt] resumed step={step} rank=1" in job.log_text("g002/rank1.log")
    assert "done step=60 rank=1" in job.log_text("g002/rank1.log")
    assert not list(Path("/dev/shm").glob(f"transom-{job.job_id}-*")), (
        "checkpoint memory outlived the job"
    )
    kinds = {(e.get("action"), e.get("tier")) for e in job.events() if e["kind"] == "checkpoint"}
    assert {
        ("saved", "memory"),
        ("replicated", "peer"),
        ("persisted", "storage"),
        ("restored", "memory"),
    } <= kinds


def test_spare_restores_the_dead_nodes_ranks_from_the_peer_replica_prefetched(start_job):
    # A 4 s lease (the default is 8): the dead node is evicted well before the job could end.
    job = start_job(
        "--nnodes", "2", "--spares", "1", "--nproc-per-node", "1", "--node-ttl", "4", SCRIPT, *SMALL
    )  # fmt: skip
    wait_for(lambda: saved_step(job) >= 6, 90, "two checkpoints in memory")
    agent = wait_for(
        lambda: next(
            (
                p
                for p in job_processes(job.job_id)
                if "agent" in p.cmdline() and "node1" in p.cmdline()
            ),
            None,
        ),
        10,
        "node1's agent",
    )
    agent.send_signal(
        signal.SIGKILL
    )  # the node dies: its workers and its checkpoint server with it
    assert job.wait() == 0, job.output
    record = job.status()["job"]
    assert record["members"] == ["node0", "node2"]
    step = next(e for e in job.events() if e["kind"] == "generation" and e["generation"] == 2)[
        "restore_step"
    ]
    assert step is not None and step >= 6
    # node2 took node1's place (rank 1): node0 holds node1's replica, and node2's server fetched
    # it into its own memory as soon as the plan named the restore step (checkpoint/prefetch.py).
    ranks = restored(job, 2)
    assert ranks[1] == (step, "memory")
    # Rank 0 reads its own node's memory if that still holds the restore step. Memory keeps one
    # step a rank, so if node0 saved a newer step that the dead node never finished, the restore
    # step is only in storage for rank 0 (right, if slower; seen once in a full run).
    assert ranks[0] in ((step, "memory"), (step, "storage")) and set(ranks) == {0, 1}
    assert any(
        e["kind"] == "checkpoint" and e.get("action") == "prefetched" and e.get("node") == "node2"
        for e in job.events()
    )
    assert "done step=30 rank=1" in job.log_text("g002/rank1.log")
    assert not list(Path("/dev/shm").glob(f"transom-{job.job_id}-*")), (
        "checkpoint memory outlived the job"
    )
