"""End to end: an unmodified torchrun-style DDP script (tests/scripts/ddp_toy.py, no transom
import) under `transom run` on 2 nodes and 1 spare gets hang detection from the worker bootstrap
alone: rank 1's worker SIGSTOPped from outside mid-run is found as a hang naming that rank, with
where every rank is (stopped, or waiting in the backward pass), a new generation takes the spare,
and the job finishes with the weights of a fault-free run."""

from __future__ import annotations

import re
import time

import pytest
import torch
from conftest import TOY, wait_for

pytestmark = pytest.mark.slow

STEPS = 60
ARGS = ["--steps", str(STEPS), "--step-delay", "0.1"]


def steps_logged(job) -> int:
    found = re.findall(r"^step (\d+) loss", job.log_text("g001/rank0.log"), re.M)
    return int(found[-1]) if found else 0


def test_a_stopped_rank_of_an_unmodified_ddp_script_is_found_with_stacks_and_replaced(start_job):
    job = start_job("--nnodes", "2", "--spares", "1", TOY, *ARGS)
    wait_for(lambda: steps_logged(job) >= 15, 120, lambda: f"step 15 in {job.output}")
    worker = wait_for(lambda: job.worker(1), 10, "rank 1's worker")
    worker.suspend()  # SIGSTOP, from outside, as a stuck machine or a debugger would
    stopped_at = time.time()
    assert job.wait() == 0, job.output
    hang = next((e for e in job.events() if e.get("type") == "hang"), None)
    assert hang is not None, [(e["kind"], e["message"]) for e in job.events()]
    assert hang["ranks"] == [1] and hang["nodes"] == ["node1"]
    assert hang["evidence"]["why"] == "heartbeat stopped"
    # The stopped rank is named as such; the other waits in DDP's all-reduce, in backward().
    assert hang["evidence"]["where"]["1"] == "stopped", hang
    assert hang["evidence"]["where"]["0"].startswith("in backward at ddp_toy.py:"), hang
    assert "rank 1: stopped; rank 0: in backward at ddp_toy.py:" in hang["message"]
    # Steps of about 0.1 s: the target is max(10 s, 5 x the median step) = 10 s.
    detected_s = hang["time"] - stopped_at
    print(f"hang found {detected_s:.1f} s after rank 1 was stopped")
    assert 0 < detected_s < 10.0, detected_s
    record = job.status()["job"]
    assert record["generation"] == 2 and record["members"] == ["node0", "node2"]
    assert "node1" in record["evicted"]
    # The same job without a fault: the final weights are bit-identical.
    reference = start_job("--nnodes", "2", TOY, *ARGS)
    assert reference.wait() == 0, reference.output
    ours = torch.load(job.run_dir / "checkpoints" / "toy.pt", weights_only=True)
    theirs = torch.load(reference.run_dir / "checkpoints" / "toy.pt", weights_only=True)
    assert ours["step"] == theirs["step"] == STEPS
    assert all(torch.equal(ours["model"][k], theirs["model"][k]) for k in theirs["model"])
