"""The Hugging Face integration against the real `transformers` Trainer: a tiny GPT-2 from a
config, run through the worker bootstrap and reporting to a real node agent's monitor with the
one-line `TransomCallback`: the Trainer's own step numbers, each step once, with its loss and
timing, and a NaN loss found as a `nan` anomaly at the step it happened."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import (
    monitored_ranks,
    rank_logs,
    ranks_finished,
    skip_unless_installed,
    wait_for,
)

from transom.monitor import rank_timing

skip_unless_installed("transformers")

HF = Path(__file__).resolve().parent / "scripts" / "hf_tiny.py"


@pytest.mark.integration
def test_the_trainer_reports_its_steps_once_with_their_loss(tmp_path):
    args = ["--out", str(tmp_path / "out"), "--steps", "12"]
    with monitored_ranks(tmp_path, HF, args, world=1) as (monitor, procs):
        ranks_finished(procs, tmp_path, timeout=180)
        wait_for(lambda: monitor.steps() == {0: 12}, 10, "the last step")
        track = monitor.ranks[0]
        summary, events = monitor.collect()
    assert "hf done steps=12" in rank_logs(tmp_path, 1)
    # Steps 1..12 as the Trainer counts them, each once, each with a finite loss.
    assert track.first_step == 1 and len(track.losses) == 12
    assert all(math.isfinite(v) for v in track.losses)
    # Timed by the optimizer hook: a step time for the monitor's statistics.
    assert summary.ranks["0"].step_s is not None and summary.ranks["0"].step_s > 0
    assert not [e for e in events if e.to_dict().get("type") == "nan"]


@pytest.mark.integration
def test_a_step_that_held_an_evaluation_is_reported_without_its_timing(tmp_path):
    """An evaluation of 8 samples of 0.15 s each after step 8: step 9, whose time held it, is
    reported (its number, its loss) but left out of the step times, as the hook's own steps
    that hold an evaluation are (transom.monitor.eval_phase)."""
    args = ["--out", str(tmp_path / "out"), "--steps", "16"]
    args += ["--eval-steps", "8", "--eval-delay", "0.15"]
    with monitored_ranks(tmp_path, HF, args, world=1) as (monitor, procs):
        ranks_finished(procs, tmp_path, timeout=180)
        wait_for(lambda: monitor.steps() == {0: 16}, 10, "the last step")
        track = monitor.ranks[0]
    assert len(track.losses) == 16  # every step reported
    # The timing window holds the newest 8 comparable steps: 8 and 10..16, not step 9.
    assert len(track.durations) == rank_timing.TIMING_WINDOW == 8
    assert max(track.durations) < 1.0, list(track.durations)


@pytest.mark.integration
def test_a_nan_loss_is_found_at_its_step(tmp_path):
    args = ["--out", str(tmp_path / "out"), "--steps", "8", "--nan-step", "5"]
    with monitored_ranks(tmp_path, HF, args, world=1) as (monitor, procs):
        ranks_finished(procs, tmp_path, timeout=180)
        wait_for(lambda: monitor.steps() == {0: 8}, 10, "the last step")
        _, events = monitor.collect()
    nans = [e.to_dict() for e in events if e.to_dict().get("type") == "nan"]
    assert nans and nans[0]["step"] == 5 and nans[0]["ranks"] == [0], nans


@pytest.mark.parametrize(
    ("name", "rank", "sent"),
    [
        ("model.safetensors", 0, True),
        ("optimizer.pt", 1, False),
        ("rng_state_0.pth", 0, True),
        ("rng_state_1.pth", 0, False),
        ("rng_state_1.pth", 1, True),
        ("rng_state.pth", 0, True),
    ],
)
def test_each_rank_sends_its_own_files_of_a_checkpoint_folder(name, rank, sent):
    from transom.integrations import hf

    assert hf._own_file(name, rank) is sent
