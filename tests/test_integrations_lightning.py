"""The Lightning integration against the real `lightning` package: a tiny model run through the
worker bootstrap with the one-line `TransomCallback`, reporting to a real node agent's monitor
(Lightning's step numbers once each with the loss; a NaN found at its step), and the
`TransomCheckpointIO` plugin: ModelCheckpoint's saves go through transom.checkpoint (the file
Lightning asked for is a marker) and a run resumed from one ends bit-identical to an
uninterrupted run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    REPO,
    monitored_ranks,
    rank_logs,
    ranks_finished,
    skip_unless_installed,
    wait_for,
)

skip_unless_installed("lightning")
pytestmark = pytest.mark.integration  # real worker processes
torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent / "scripts" / "lightning_tiny.py"


def test_the_callback_reports_lightnings_steps_once_with_their_loss(tmp_path):
    args = ["--dir", str(tmp_path / "run"), "--steps", "10"]
    with monitored_ranks(tmp_path, SCRIPT, args, world=1) as (monitor, procs):
        ranks_finished(procs, tmp_path, timeout=180)
        wait_for(lambda: monitor.steps() == {0: 10}, 10, "the last step")
        track = monitor.ranks[0]
        summary, _ = monitor.collect()
    assert "lightning done steps=10" in rank_logs(tmp_path, 1)
    assert track.first_step == 1 and len(track.losses) == 10
    assert all(math.isfinite(v) for v in track.losses)
    assert summary.ranks["0"].step_s is not None


def test_a_nan_loss_is_found_at_its_step(tmp_path):
    args = ["--dir", str(tmp_path / "run"), "--steps", "8", "--nan-step", "4"]
    with monitored_ranks(tmp_path, SCRIPT, args, world=1) as (monitor, procs):
        ranks_finished(procs, tmp_path, timeout=180)
        wait_for(lambda: monitor.steps() == {0: 8}, 10, "the last step")
        _, events = monitor.collect()
    nans = [e.to_dict() for e in events if e.to_dict().get("type") == "nan"]
    assert nans and nans[0]["step"] == 4, nans


def run(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_checkpoints_go_through_the_engine_and_a_resumed_run_ends_bit_identical(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run("--dir", str(straight), "--steps", "10", "--weights", str(tmp_path / "a.pt"))
    # Stop after step 5 (its checkpoint saved through the plugin), then resume from it.
    run("--dir", str(resumed), "--steps", "5", "--ckpt-every", "5")
    markers = sorted(resumed.glob("*.ckpt"))
    assert [json.loads(m.read_text()) for m in markers] == [{"transom_step": 5}], markers
    assert (resumed / "storage" / "latest").exists()  # the engine's storage tier holds it
    run(
        *("--dir", str(resumed), "--steps", "10", "--resume-step", "5"),
        *("--weights", str(tmp_path / "b.pt")),
    )
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_step_snapshots_persist_at_modelcheckpoints_steps_and_resume_mid_epoch(tmp_path):
    """`TransomCheckpoints`: a snapshot every step; ModelCheckpoint's step-5 save persists that
    step's snapshot; closing persists the newest (7, mid-epoch); a run resumed from it ends
    bit-identical to an uninterrupted one (data chosen by the step)."""
    from transom.checkpoint import storage

    straight, snapped = tmp_path / "straight", tmp_path / "snapped"
    data = "--step-data"
    run("--dir", str(straight), "--steps", "10", data, "--weights", str(tmp_path / "a.pt"))
    run("--dir", str(snapped), "--steps", "7", data, "--snapshots", "--ckpt-every", "5")
    markers = sorted(snapped.glob("*.ckpt"))
    assert [json.loads(m.read_text()) for m in markers] == [{"transom_step": 5}], markers
    assert storage.complete_steps(snapped / "storage") == [7, 5]
    run(
        *("--dir", str(snapped), "--steps", "10", data, "--resume-step", "7"),
        *("--weights", str(tmp_path / "b.pt")),
    )
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
