"""A job's claim on its checkpoint storage: one live job at a time, a rerun resumes the newest
steps whatever its job id, --fresh resumes nothing and deletes nothing unless asked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_checkpoint_timeline import _write

from transom.checkpoint import shard_format, storage
from transom.checkpoint.storage_claim import (
    ANY_JOB,
    OWNER,
    StorageBusy,
    claim,
    read_owner,
)


def _steps(root: Path, job: str, steps: tuple[int, ...], world: int = 1) -> None:
    tl = shard_format.Timeline(job, 1, world)
    for step in steps:
        for rank in range(world):
            _write(root, step, rank, tl, keep=9)


def test_a_rerun_resumes_the_previous_jobs_steps_whatever_its_job_id(tmp_path: Path) -> None:
    first = claim(tmp_path, "job-a")
    assert first.resumes is None and first.steps == []  # nothing there yet
    _steps(tmp_path, "job-a", (8400, 8420, 8440), world=2)
    first.release()
    second = claim(tmp_path, "job-b")  # a new job id
    assert (second.resumes, second.steps) == ("job-a", [8440, 8420, 8400])
    second.release()  # job-b died before saving anything of its own
    third = claim(tmp_path, "job-c")
    assert (third.resumes, third.steps) == ("job-a", [8440, 8420, 8400])
    _steps(tmp_path, "job-c", (8460,), world=2)
    third.release()
    again = claim(tmp_path, "job-c")  # the same job id again
    assert (again.resumes, again.steps) == ("job-c", [8460])
    again.release()
    assert storage.complete_steps(tmp_path) == [8460, 8440, 8420, 8400]  # nothing deleted


def test_fresh_resumes_nothing_and_a_later_rerun_goes_on_from_the_fresh_jobs_steps(
    tmp_path: Path,
) -> None:
    _steps(tmp_path, "job-a", (8400, 8440))
    claim(tmp_path, "job-a").release()
    fresh = claim(tmp_path, "job-b", fresh=True)
    assert fresh.resumes is None and fresh.steps == []
    assert storage.complete_steps(tmp_path) == [8440, 8400]  # kept
    _steps(tmp_path, "job-b", (20, 40))
    fresh.release()
    rerun = claim(tmp_path, "job-c")
    assert (rerun.resumes, rerun.steps) == ("job-b", [40, 20])  # not job-a's older history
    rerun.release()


def test_fresh_with_discard_removes_every_step(tmp_path: Path) -> None:
    _steps(tmp_path, "job-a", (10, 20))
    c = claim(tmp_path, "job-b", fresh=True, discard=True)
    assert storage.complete_steps(tmp_path) == [] and storage.latest_step(tmp_path) is None
    c.release()


def test_a_directory_older_than_owner_records_is_resumed_from_all_its_steps(
    tmp_path: Path,
) -> None:
    _steps(tmp_path, "job-a", (10,))
    _steps(tmp_path, "job-b", (20,))
    c = claim(tmp_path, "job-c")
    assert (c.resumes, c.steps) == (ANY_JOB, [20, 10])
    c.release()


def test_a_malformed_owner_record_is_ignored(tmp_path: Path) -> None:
    _steps(tmp_path, "job-a", (10,))
    for bad in ("{", json.dumps({"job": 3}), json.dumps({"job": "../x"}), json.dumps([1])):
        (tmp_path / OWNER).write_text(bad)
        assert read_owner(tmp_path) is None
        c = claim(tmp_path, "job-b")
        assert c.steps == [10]
        c.release()


HOLDER = """
import sys
from transom.checkpoint.storage_claim import claim
c = claim(sys.argv[1], sys.argv[2])
print("claimed", flush=True)
sys.stdin.read()
"""


@pytest.mark.integration  # a process of its own holds the first job's claim
def test_a_second_live_job_is_refused_and_a_dead_ones_claim_is_taken_over(
    tmp_path: Path,
) -> None:
    _steps(tmp_path, "job-a", (10,))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), "job-a"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
        with pytest.raises(StorageBusy, match="in use by job job-a, which is still running"):
            claim(tmp_path, "job-b")
        owner = read_owner(tmp_path)
        assert owner is not None and owner.job == "job-a"  # the refused claim changed nothing
        same = claim(tmp_path, "job-a")  # another machine of the running job shares it
        assert same.steps == [10]
        same.release()
    finally:
        holder.kill()
        holder.wait()
    after = claim(tmp_path, "job-b")  # job-a's launcher is gone: its lock with it
    assert (after.resumes, after.steps) == ("job-a", [10])
    assert sorted(p.name for p in (tmp_path / ".jobs").iterdir()) == ["job-b.lock"]
    after.release()
    assert storage.complete_steps(tmp_path) == [10]


def test_a_lock_file_that_names_no_job_is_left_alone(tmp_path: Path) -> None:
    odd = tmp_path / ".jobs" / "\x1b[31mred.lock"
    odd.parent.mkdir(parents=True)
    odd.write_text("")
    c = claim(tmp_path, "job-a")
    assert odd.exists()  # not a job's lock: neither taken for one nor removed
    c.release()
