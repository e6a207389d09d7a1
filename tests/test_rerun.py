"""End-to-end: a rerun of `transom run` on the same checkpoint storage resumes from its newest
step, with a new job id and with the same one, and deletes nothing of the earlier job; a second
job on a storage a live job holds is refused."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import SMALL_GPT, wait_for

from transom.checkpoint import storage

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
KEEP = 3


def _args(store: Path, steps: int) -> list:
    return [
        "--nnodes", "2", "--ckpt-storage", store, "--ckpt-keep", str(KEEP),
        SCRIPT, *SMALL_GPT, "--ckpt-every", "10", "--steps", str(steps), "--step-delay", "0.05",
    ]  # fmt: skip


def _first_generation(job) -> dict:
    return next(e for e in job.events() if e["kind"] == "generation")


def _resume_event(job) -> dict:
    return next(e for e in job.events() if e.get("action") == "resume")


def _old_steps_kept(store: Path, old: list[int], job_id: str) -> None:
    """Every step of `old` is still there, unless job `job_id` has KEEP newer complete ones."""
    complete = storage.complete_steps(store)
    for step in set(old) - set(complete):
        newer = [s for s in complete if s > step and storage.manifest_job(store, s) == job_id]
        assert len(newer) >= KEEP, f"step {step} of the old job gone; complete now: {complete}"


def _stopped_after_two_persisted_steps(start_job, store: Path) -> tuple[object, list[int]]:
    job = start_job(*_args(store, 100000))
    wait_for(lambda: len(storage.complete_steps(store)) >= 2, 120, "two steps in storage")
    job.process.send_signal(signal.SIGTERM)
    assert job.wait(60) == 143, job.output
    return job, storage.complete_steps(store)


def test_a_rerun_resumes_from_storage_with_a_new_job_id_and_with_the_same(
    start_job, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    first, old = _stopped_after_two_persisted_steps(start_job, store)
    newest = old[0]

    second = start_job(*_args(store, newest + 40))  # a new job id, a new run directory
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # nothing of the first job goes while the second runs
        _old_steps_kept(store, old, second.job_id)
        try:
            second.process.wait(0.3)
            break
        except subprocess.TimeoutExpired:
            continue
    assert second.wait() == 0, second.output
    resume = _resume_event(second)
    assert resume["step"] == newest and resume["resumes"] == first.job_id
    assert f"resuming from step {newest} of job {first.job_id} in {store}" in resume["message"]
    assert _first_generation(second)["restore_step"] == newest
    assert f"[train_gpt] restored step={newest}" in second.log_text()
    _old_steps_kept(store, old, second.job_id)

    # The same job id again, in the same run directory (its default): it goes on from its own
    # newest step, with a control plane of its own (the earlier run's files are kept aside).
    mine = storage.complete_steps(store)[0]
    third = start_job(*_args(store, mine + 10), job_id=second.job_id, run_dir=second.run_dir)
    assert third.wait() == 0, third.output
    assert _resume_event(third)["step"] == mine
    assert _first_generation(third)["restore_step"] == mine
    assert [e["kind"] for e in third.events()][:2] == ["checkpoint", "leader"]  # its own record
    assert len(list((second.run_dir / "previous").glob("*/events.jsonl"))) == 1


def test_a_second_job_on_storage_a_live_job_holds_is_refused_and_deletes_nothing(
    start_job, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    first = start_job(*_args(store, 100000))
    wait_for(lambda: len(storage.complete_steps(store)) >= 1, 120, "a step in storage")
    second = start_job(*_args(store, 50))
    assert second.wait(60) == 2, second.output
    assert f"in use by job {first.job_id}, which is still running" in second.output
    assert first.process.poll() is None  # the first job goes on
    wait_for(lambda: len(storage.complete_steps(store)) >= 2, 60, "the first job persisting more")
    assert all(
        storage.manifest_job(store, s) == first.job_id for s in storage.complete_steps(store)
    )
    first.process.send_signal(signal.SIGTERM)
    assert first.wait(60) == 143, first.output
