"""End to end: unmodified scripts (no transom import) under `transom run` on 2 nodes and 1 spare
get hang detection from the worker bootstrap alone: a torchrun-style DDP script
(tests/scripts/ddp_toy.py) and a Hugging Face `Trainer` script (examples/hf_trainer_unmodified.py).
Rank 1's worker SIGSTOPped from outside mid-run is found as a hang naming that rank, with where
every rank is (stopped, or waiting in the backward pass), a new generation takes the spare, and
the job finishes with the weights of a fault-free run."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, TOY, wait_for

pytestmark = pytest.mark.slow

STEPS = 60
ARGS = ["--steps", str(STEPS), "--step-delay", "0.1"]


def steps_logged(job) -> int:
    found = re.findall(r"^step (\d+) loss", job.log_text("g001/rank0.log"), re.M)
    return int(found[-1]) if found else 0


def alarms(job) -> list[dict]:
    """The job's events a fault-free run must not have: anomalies above info, decisions,
    warnings and incidents."""
    return [
        e
        for e in job.events()
        if (e["kind"] == "anomaly" and e.get("severity") != "info")
        or e["kind"] in ("decision", "warning", "incident")
    ]


def assert_hang_found_with_stacks(
    job, stopped_at: float, script: str, waits: tuple[str, ...] = ("backward",)
) -> None:
    """The hang anomaly names rank 1 on node1 as stopped and rank 0 as waiting in one of `waits`
    (backward(): DDP's gradient all-reduce; the Hugging Face Trainer also makes an all_gather
    each step, and the stop may land in either), within max(10 s, 5 x the median step) = 10 s of the
    stop for steps of about 0.1 s, and generation 2 runs on node0 and the spare."""
    hang = next((e for e in job.events() if e.get("type") == "hang"), None)
    assert hang is not None, [(e["kind"], e["message"]) for e in job.events()]
    assert hang["ranks"] == [1] and hang["nodes"] == ["node1"]
    # Found stopped by its agent (2 s without progress), before or after its heartbeat's 3 s gap.
    assert hang["evidence"]["why"] in ("heartbeat stopped", "process stopped"), hang
    assert hang["evidence"]["where"]["1"] == "stopped", hang
    # In the backward pass (DDP's all-reduce) or another collective of `waits`, called from the
    # script's line or its framework's.
    waiting = rf"in ({'|'.join(waits)})(, from \w+)? at {re.escape(script)}:\d+"
    assert re.fullmatch(waiting, hang["evidence"]["where"]["0"]), hang
    assert re.search(rf"rank 1: stopped; rank 0: {waiting}$", hang["message"]), hang
    detected_s = hang["time"] - stopped_at
    print(f"hang found {detected_s:.1f} s after rank 1 was stopped: {hang['message']}")
    assert 0 < detected_s < 10.0, detected_s
    record = job.status()["job"]
    assert record["generation"] == 2 and record["members"] == ["node0", "node2"]
    assert "node1" in record["evicted"]
    # `transom events` says it to a person, from the run directory.
    shown = subprocess.run(
        [sys.executable, "-m", "transom", "events", "--run-dir", str(job.run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert re.search(rf"rank 1: stopped; rank 0: {waiting}", shown.stdout), (
        shown.stdout + shown.stderr
    )


def test_a_stopped_rank_of_an_unmodified_ddp_script_is_found_with_stacks_and_replaced(start_job):
    job = start_job("--nnodes", "2", "--spares", "1", TOY, *ARGS)
    wait_for(lambda: steps_logged(job) >= 15, 120, lambda: f"step 15 in {job.output}")
    worker = wait_for(lambda: job.worker(1), 10, "rank 1's worker")
    worker.suspend()  # SIGSTOP, from outside, as a stuck machine or a debugger would
    stopped_at = time.time()
    assert job.wait() == 0, job.output
    assert_hang_found_with_stacks(job, stopped_at, "ddp_toy.py")
    # The run report's incidents say it too.
    from transom.report import write_report

    summary = write_report(job.run_dir)
    causes = [i["cause"] or "" for i in summary["incidents"]]
    assert any("rank 1: stopped; rank 0: in backward at ddp_toy.py:" in c for c in causes), causes
    # The same job without a fault: the final weights are bit-identical.
    reference = start_job("--nnodes", "2", TOY, *ARGS)
    assert reference.wait() == 0, reference.output
    ours = torch.load(job.run_dir / "checkpoints" / "toy.pt", weights_only=True)
    theirs = torch.load(reference.run_dir / "checkpoints" / "toy.pt", weights_only=True)
    assert ours["step"] == theirs["step"] == STEPS
    assert all(torch.equal(ours["model"][k], theirs["model"][k]) for k in theirs["model"])


HF = str(REPO / "examples" / "hf_trainer_unmodified.py")
HF_ARGS = ["--steps", "60", "--save-steps", "10", "--data-delay", "0.1"]


def test_a_stopped_rank_of_an_unmodified_hf_trainer_script_is_found_and_replaced(start_job):
    env = {"HF_HUB_OFFLINE": "1"}
    job = start_job("--nnodes", "2", "--spares", "1", HF, *HF_ARGS, env=env)
    hf_dir = job.run_dir / "checkpoints" / "hf"
    wait_for(lambda: (hf_dir / "checkpoint-20").is_dir(), 240, lambda: job.output)
    worker = wait_for(lambda: job.worker(1), 10, "rank 1's worker")
    worker.suspend()
    stopped_at = time.time()
    assert job.wait(timeout=300) == 0, job.output
    assert_hang_found_with_stacks(
        job, stopped_at, "hf_trainer_unmodified.py", ("backward", "all_gather")
    )
    assert "resuming from" in job.log_text("g002/rank0.log")
    reference = start_job("--nnodes", "2", HF, *HF_ARGS, env=env)
    assert reference.wait(timeout=300) == 0, reference.output
    from safetensors.torch import load_file

    ours = load_file(hf_dir / "final" / "model.safetensors")
    theirs = load_file(reference.run_dir / "checkpoints" / "hf" / "final" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_throttled_node_of_an_unmodified_ddp_script_is_the_straggler_the_others_wait_for(
    start_job,
):
    """The wait DDP's all-reduce spends, timed by the bootstrap's communication hook, names the
    node the others wait for: rank 1 run 1/3 of the time from outside (SIGSTOP/SIGCONT every
    0.1 s) is found within 30 steps and replaced by the spare."""
    job = start_job(
        *("--nnodes", "2", "--spares", "1", "--faults", "throttle@step=20:node=node1:factor=3"),
        TOY,
        *("--steps", "150", "--step-delay", "0.05"),
    )
    assert job.wait() == 0, job.output
    fault = next(e for e in job.events() if e["kind"] == "fault")
    straggler = next((e for e in job.events() if e.get("type") == "straggler"), None)
    assert straggler is not None, [(e["kind"], e["message"]) for e in job.events()]
    assert straggler["nodes"] == ["node1"] and straggler["ranks"] == [1]
    assert "the one the others wait for" in straggler["message"]
    evidence = straggler["evidence"]
    assert evidence["peers_wait_s"] > evidence["wait_s"]  # rank 0 waits in DDP's all-reduce
    assert 0 < straggler["step"] - fault["step"] <= 30, (fault["step"], straggler["step"])
    assert "node1" in job.status()["job"]["evicted"]
    assert not [e for e in job.events() if e.get("type") == "hang"]


def test_an_unmodified_scripts_long_evaluation_is_no_hang(start_job):
    """Three times in the run both ranks evaluate for 5 s (the model in eval mode, forward
    passes and all_reduces, no optimizer step; a framework's evaluation loop does the same), with
    a hang floor of 2 s and a spare to evict to: the bootstrap sees the evaluation from the model's
    eval() alone, and the job trains through them in one generation, with no anomaly."""
    job = start_job(
        *("--nnodes", "2", "--spares", "1", "--hang-floor", "2"),
        TOY,
        *("--steps", "30", "--step-delay", "0.05", "--eval-every", "10", "--eval-s", "5"),
    )
    assert job.wait() == 0, job.output
    assert len(re.findall(r"^eval step \d+", job.log_text("g001/rank0.log"), re.M)) == 3
    assert not alarms(job), [(e["kind"], e["message"]) for e in alarms(job)]
    assert job.status()["job"]["generation"] == 1


def test_an_unmodified_hf_trainers_long_evaluation_is_no_hang(start_job):
    """The real Trainer evaluates every 10 steps, each evaluation 32 slow samples a rank (about
    5 s: the Trainer's evaluation loop, its model in eval mode, its loss gathered across ranks),
    with a hang floor of 2 s and a spare: one generation, no anomaly, every evaluation done."""
    job = start_job(
        *("--nnodes", "2", "--spares", "1", "--hang-floor", "2"),
        HF,
        *("--steps", "30", "--save-steps", "10", "--data-delay", "0.05"),
        *("--eval-steps", "10", "--eval-delay", "0.15"),
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert job.wait(timeout=300) == 0, job.output
    evaluations = re.findall(r"^eval step (\d+) loss", job.log_text("g001/rank0.log"), re.M)
    assert evaluations == ["10", "20", "30"], job.log_text("g001/rank0.log")[-2000:]
    assert not alarms(job), [(e["kind"], e["message"]) for e in alarms(job)]
    assert job.status()["job"]["generation"] == 1


@pytest.mark.parametrize("where", ["main", "child"])
def test_an_unmodified_scripts_long_work_outside_a_step_is_no_hang(start_job, where):
    """Three times in the run rank 0 works 5 s outside a step while the other rank waits at a
    barrier, with a hang floor of 4 s (three looks before the timeout) and a spare to evict to: in
    its main thread (samples from the model, which is not in eval mode), or in a DataLoader's
    worker process (an epoch's slow first batch). No phase marks either; the agents' looks find
    rank 0 at work, and the job trains through them in one generation, with no anomaly."""
    job = start_job(
        *("--nnodes", "2", "--spares", "1", "--hang-floor", "4"),
        TOY,
        *("--steps", "30", "--step-delay", "0.05", "--busy-every", "10", "--busy-s", "5"),
        *("--busy-in", where),
    )
    assert job.wait() == 0, job.output
    assert len(re.findall(r"^busy after step \d+", job.log_text("g001/rank0.log"), re.M)) == 3
    assert not alarms(job), [(e["kind"], e["message"]) for e in alarms(job)]
    assert job.status()["job"]["generation"] == 1


def test_an_unmodified_hf_trainers_long_work_after_a_save_is_no_hang(start_job):
    """The real Trainer saves every 10 steps, and a plain callback of the script makes the main
    process write sample completions for 5 s after each save (the model's generate, not in eval
    mode), while the other rank waits in the next step's all-reduce; a hang floor of 4 s (three
    looks before the timeout) and a spare: one generation, no anomaly, every save's samples
    written."""
    job = start_job(
        *("--nnodes", "2", "--spares", "1", "--hang-floor", "4"),
        HF,
        *("--steps", "30", "--save-steps", "10", "--data-delay", "0.05"),
        *("--after-save-s", "5"),
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert job.wait(timeout=300) == 0, job.output
    written = re.findall(r"^samples after step (\d+): \d+", job.log_text("g001/rank0.log"), re.M)
    assert written == ["10", "20", "30"], job.log_text("g001/rank0.log")[-2000:]
    assert not alarms(job), [(e["kind"], e["message"]) for e in alarms(job)]
    assert job.status()["job"]["generation"] == 1


@pytest.mark.parametrize("how", ["sleep", "spin", "poll"])
def test_a_rank_that_waits_forever_outside_a_step_is_a_hang_whatever_its_shape(start_job, how):
    """Rank 0 waits forever after step 5 (in a blocking call, a spin inside one call, a polling
    loop) while rank 1 waits at a barrier, under a hang floor of 2 s and no restart allowed: the
    agents' looks find no rank at work, and the hang is declared within the timeout and the
    looks' few seconds, not after a phase's 300 s; its event says where rank 0 waits."""
    job = start_job(
        *("--nnodes", "2", "--hang-floor", "2", "--max-restarts", "0"),
        TOY,
        *("--steps", "30", "--step-delay", "0.05", "--wait-forever-at", "5", "--wait-how", how),
    )
    assert job.wait(timeout=120) != 0, job.output
    log = job.log_text("g001/rank0.log")
    began = float(re.search(r"^waiting forever t=([\d.]+)", log, re.M).group(1))
    hang = next((e for e in job.events() if e.get("type") == "hang"), None)
    assert hang is not None, [(e["kind"], e["message"]) for e in job.events()]
    assert 0 < hang["time"] - began < 8.0, (hang["time"] - began, hang["message"])
    assert "in wait_forever at ddp_toy.py" in hang["evidence"]["where"]["0"] or re.fullmatch(
        r"at ddp_toy.py:\d+ in wait_forever", hang["evidence"]["where"]["0"]
    ), hang
