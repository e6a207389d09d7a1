"""Tests for examples/train_gpt.py: it trains, and resuming from a checkpoint is bit-exact."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import SMALL_GPT

# Whole training jobs of the example (torchrun, several runs a test): seconds to half a minute each.
pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
# Small model and batch so that three torchrun jobs fit in well under a minute on two cores.
SMALL = SMALL_GPT


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TRANSOM_CHECKPOINT_DIR",
        "TRANSOM_MONITOR_SOCKET",
        "TORCHELASTIC_RUN_ID",
    ):
        env.pop(name, None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _kill_tree(pid: int) -> None:
    """Kill `pid` and everything under it (torchrun starts its workers in sessions of their own)."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _run(args: list[str], cwd: Path, timeout: float = 120) -> str:
    """Run a command to completion and return its output; no process outlives this call."""
    code, out, _ = _run_failing(args, cwd, _env(), timeout)
    assert code == 0, f"{args} exited with {code}:\n{out}"
    return out


def _torchrun(nproc: int, *args: str, cwd: Path) -> str:
    return _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(SCRIPT),
            *SMALL,
            *args,
        ],
        cwd=cwd,
    )


def test_single_process_trains(tmp_path: Path) -> None:
    out = _run(
        [
            sys.executable,
            str(SCRIPT),
            "--steps",
            "12",
            "--log-every",
            "1",
            "--ckpt-dir",
            str(tmp_path / "ckpt"),
        ],
        cwd=tmp_path,
    )
    assert re.search(r"^\[train_gpt\] start rank=0 world=1 t=\d+\.\d{3}$", out, re.M), out
    assert re.search(r"^\[train_gpt\] resumed step=0 rank=0 t=\d+\.\d{3}$", out, re.M), out
    losses = [float(m) for m in re.findall(r"^step \d+ loss (\d+\.\d{4}) t=\d+\.\d{3}$", out, re.M)]
    assert len(losses) == 12, out
    assert losses[-1] < losses[0] - 0.2, losses
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    assert re.search(r"^\[train_gpt\] done step=12 rank=0 t=\d+\.\d{3}$", out, re.M), out
    # A snapshot every step by default, storage every 20th and the run's last: only step 12.
    from transom.checkpoint import storage

    assert storage.complete_steps(tmp_path / "ckpt") == [12]


def test_falls_back_when_latest_is_corrupt(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = [
        sys.executable,
        str(SCRIPT),
        *SMALL,
        "--checkpoint",
        "torch",
        "--ckpt-dir",
        str(ckpt),
        "--ckpt-every",
        "2",
        "--keep",
        "3",
    ]
    _run(args + ["--steps", "6"], cwd=tmp_path)
    assert sorted(p.name for p in ckpt.glob("step_*.pt")) == [
        f"step_0000000{s}.pt" for s in (2, 4, 6)
    ]
    (ckpt / "step_00000006.pt").write_bytes(b"truncated")
    out = _run(args + ["--steps", "7"], cwd=tmp_path)
    assert "cannot load checkpoint" in out, out
    assert "[train_gpt] resumed step=4 rank=0" in out, out
    assert "[train_gpt] done step=7 rank=0" in out, out


@pytest.mark.parametrize("mode", ["transom", "torch"])
def test_resume_is_bit_exact(tmp_path: Path, mode: str) -> None:
    steps, every = 12, 3
    common = ["--checkpoint", mode, "--ckpt-every", str(every), "--log-every", "3", "--seed", "7"]

    # Uninterrupted run.
    out = _torchrun(
        2,
        "--steps",
        str(steps),
        "--ckpt-dir",
        str(tmp_path / "a"),
        "--save-final",
        str(tmp_path / "a.pt"),
        *common,
        cwd=tmp_path,
    )
    assert "[train_gpt] done step=12 rank=0" in out and "[train_gpt] done step=12 rank=1" in out, (
        out
    )
    assert (tmp_path / "a" / "latest").read_text().strip() == "12"
    kept = sorted(p.name for p in (tmp_path / "a").glob("step_*"))
    if mode == "torch":
        assert kept == ["step_00000009.pt", "step_00000012.pt"]
    else:  # one folder per step, a shard per rank, the manifest written last
        # Storage skips a step when it is behind and a newer one is queued (the persister's
        # latest-wins rule), so on a loaded machine the older of the two kept can be 3 or 6.
        assert kept[-1] == "step_000000000012", kept
        assert len(kept) == 2 and kept[0] in {f"step_{s:012d}" for s in (3, 6, 9)}, kept
        assert sorted(p.name for p in (tmp_path / "a" / kept[-1]).iterdir()) == [
            "manifest.json",
            "rank_000000.shard",
            "rank_000001.shard",
        ]

    # The same job, stopped halfway and started again on the same checkpoint directory.
    out = _torchrun(
        2, "--steps", str(steps // 2), "--ckpt-dir", str(tmp_path / "b"), *common, cwd=tmp_path
    )
    assert "[train_gpt] done step=6 rank=0" in out, out
    out = _torchrun(
        2,
        "--steps",
        str(steps),
        "--ckpt-dir",
        str(tmp_path / "b"),
        "--save-final",
        str(tmp_path / "b.pt"),
        *common,
        cwd=tmp_path,
    )
    assert (
        "[train_gpt] resumed step=6 rank=0" in out and "[train_gpt] resumed step=6 rank=1" in out
    ), out
    if mode == "transom":  # a new process: its memory tier is empty, storage has the shards
        assert "[train_gpt] restored step=6 rank=1 tier=storage" in out, out
    assert re.search(r"^step 7 loss ", out, re.M), out  # the first step after a resume is logged
    assert "[train_gpt] done step=12 rank=0" in out, out

    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ after resume: {different}"


def _run_failing(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 60
) -> tuple[int, str, float]:
    """Run a command that may fail: its exit code, output and run time. No process outlives it."""
    started = time.monotonic()
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"{args} ran past {timeout}s:\n{out}")
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.communicate()
    return proc.returncode, out, time.monotonic() - started


def _with_faults(faults: list[dict], tmp_path: Path) -> dict[str, str]:
    """The environment of a worker that applies `faults` itself (reporter.py needs a monitor
    socket; nothing listens at this path, which the reporter tolerates)."""
    nowhere = str(tmp_path / "no-monitor.sock")
    return _env() | {"TRANSOM_MONITOR_SOCKET": nowhere, "TRANSOM_FAULTS": json.dumps(faults)}


def test_fail_on_nan_stops_the_run_and_a_restart_resumes_past_the_fault(tmp_path: Path) -> None:
    env = _with_faults(
        [
            {
                "id": "f0",
                "type": "nan",
                "step": 5,
                "rank": None,
                "once_file": str(tmp_path / "f0.fired"),
            }
        ],
        tmp_path,
    )
    args = [
        sys.executable,
        str(SCRIPT),
        *SMALL,
        "--steps",
        "8",
        "--log-every",
        "1",
        "--checkpoint",
        "torch",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--ckpt-every",
        "2",
        "--fail-on-nan",
    ]
    code, out, _ = _run_failing(args, tmp_path, env)
    assert code != 0 and "FloatingPointError: rank 0: loss is nan at step 5" in out, out
    assert re.search(r"^step 4 loss ", out, re.M) and not re.search(r"^step 5 ", out, re.M), out
    code, out, _ = _run_failing(
        args, tmp_path, env
    )  # the same command and environment, as torchrun restarts it
    assert code == 0, out
    assert "[train_gpt] resumed step=4 rank=0" in out and re.search(
        r"^step 5 loss \d", out, re.M
    ), out
    assert "[train_gpt] done step=8 rank=0" in out, out


@pytest.mark.slow
def test_collective_timeout_ends_a_job_whose_peer_stalls(tmp_path: Path) -> None:
    """Rank 1 stalls for ~20 s in step 3 (an injected slow-down); with a 2 s collective timeout,
    rank 0's all-reduce gives up long before that (gloo's default would wait 30 minutes)."""
    env = _with_faults(
        [{"id": "f0", "type": "slow", "step": 3, "rank": 1, "factor": 2000.0}], tmp_path
    )
    code, out, seconds = _run_failing(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(SCRIPT),
            *SMALL,
            "--steps",
            "6",
            "--log-every",
            "1",
            "--ckpt-every",
            "0",
            "--collective-timeout",
            "2",
        ],
        tmp_path,
        env,
    )
    assert code != 0, out
    assert re.search(r"^\[rank0\]:.*[Tt]imed out", out, re.M), out
    assert re.search(r"^step 2 loss ", out, re.M) and not re.search(r"^step 3 ", out, re.M), out
    assert seconds < 15, f"the job took {seconds:.1f} s to fail"


def test_resumes_after_a_shrink_and_after_a_grow(tmp_path: Path) -> None:
    """3 ranks train to step 4; 2 ranks resume there (resharded) and train to step 6; 3 ranks
    resume at step 6. Never from step 0: every value train_gpt saves is declared replicated."""
    common = ["--ckpt-every", "2", "--log-every", "2", "--ckpt-dir", str(tmp_path / "c")]
    out = _torchrun(3, "--steps", "4", *common, cwd=tmp_path)
    assert "[train_gpt] done step=4 rank=2" in out, out
    out = _torchrun(2, "--steps", "6", *common, cwd=tmp_path)
    for rank in (0, 1):
        assert f"[train_gpt] resumed step=4 rank={rank}" in out, out
        assert re.search(rf"restored step=4 rank={rank} .*resharded_from=3", out), out
    assert "[train_gpt] done step=6 rank=1" in out, out
    out = _torchrun(3, "--steps", "8", *common, cwd=tmp_path)
    for rank in (0, 1, 2):
        assert f"[train_gpt] resumed step=6 rank={rank}" in out, out
    assert re.search(r"restored step=6 rank=2 .*resharded_from=2", out), out
    assert "[train_gpt] done step=8 rank=2" in out, out
