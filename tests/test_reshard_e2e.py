"""End-to-end: an elastic job (`--nnodes 2:3`, no spare) loses a node, goes on with 2 nodes from
its newest checkpoint, and grows back to 3 from the newest checkpoint of the 2-node world.

The state is examples/train_gpt.py's: DDP-replicated model and optimizer (declared replicated).
DCP-sharded state (DTensors) across a change of world size is shown by real process groups in
tests/test_reshard.py (a whole job per sharding would double this test's minutes).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from conftest import SMALL_GPT, agent_process, wait_for

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
ARGS = [
    *SMALL_GPT,
    *("--ckpt-every", "3", "--log-every", "1", "--steps", "90", "--step-delay", "0.15"),
]


def generation(job, number: int) -> dict | None:
    return next(
        (e for e in job.events() if e["kind"] == "generation" and e["generation"] == number), None
    )


def saved_steps(job) -> list[int]:
    """Steps saved in memory, per the checkpoint events."""
    return [
        e["step"] for e in job.events() if e["kind"] == "checkpoint" and e.get("action") == "saved"
    ]


def resumed(job, generation: int) -> dict[int, tuple[int, int | None]]:
    """rank -> (resumed step, world size resharded from) in one generation's logs."""
    logs = job.log_text(f"g{generation:03d}/rank*.log")
    steps = {
        int(m.group(2)): int(m.group(1))
        for m in re.finditer(r"\[train_gpt\] resumed step=(\d+) rank=(\d+)", logs)
    }
    sources = {
        int(m.group(1)): int(m.group(2))
        for m in re.finditer(r"restored step=\d+ rank=(\d+) .*resharded_from=(\d+)", logs)
    }
    return {rank: (step, sources.get(rank)) for rank, step in steps.items()}


def test_lost_node_shrinks_then_a_new_node_grows_the_job_without_going_back(start_job):
    job = start_job("--nnodes", "2:3", "--refill-spares", "--nproc-per-node", "1", SCRIPT, *ARGS)
    wait_for(lambda: max(saved_steps(job), default=0) >= 6, 120, "two checkpoints")
    agent = wait_for(lambda: agent_process(job.job_id, "node1"), 10, "node1's agent")
    agent.send_signal(signal.SIGKILL)  # the node dies with its workers and checkpoint memory

    # Shrink: no spare, so generation 2 runs on the 2 survivors, from a step saved by 3 ranks.
    shrunk = wait_for(lambda: generation(job, 2), 120, "generation 2")
    assert shrunk["members"] == ["node0", "node2"], shrunk
    step2 = shrunk["restore_step"]
    assert step2 is not None and step2 >= 6, shrunk
    wait_for(lambda: len(resumed(job, 2)) == 2, 120, "generation 2's ranks to resume")
    assert resumed(job, 2) == {0: (step2, 3), 1: (step2, 3)}, job.log_text("g002/rank*.log")

    # The cluster gives a new node (--refill-spares): it waits as a spare; the 2-node world
    # saves newer steps. The next restart (a worker killed) takes the spare: 3 nodes again.
    wait_for(lambda: "node3" in job.status().get("nodes", {}), 120, "node3 to join as a spare")
    newer = step2 + 7  # past a checkpoint of the 2-node world (every 3 steps)
    wait_for(lambda: f"step {newer} loss" in job.log_text("g002/rank0.log"), 120, f"step {newer}")
    victim = wait_for(lambda: job.worker(0), 10, "generation 2's rank 0 worker")
    victim.send_signal(signal.SIGKILL)
    grown = wait_for(lambda: generation(job, 3), 120, "generation 3")
    assert sorted(grown["members"]) == ["node0", "node2", "node3"], grown
    step3 = grown["restore_step"]
    assert step3 is not None and step3 > step2, (step2, grown)

    assert job.wait(300) == 0, job.output
    assert resumed(job, 3) == {r: (step3, 2) for r in range(3)}, job.log_text("g003/rank*.log")
    assert "done step=90 rank=2" in job.log_text("g003/rank2.log")
