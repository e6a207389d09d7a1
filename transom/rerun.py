"""What a launcher holds when a job starts, so that running the same command again is safe.

* `hold_run_dir`: on one machine the run directory is held by one `transom run` at a time (a
  second one is refused), and what an earlier run left there (its etcd's state of a job that
  is over, its events, status, progress, logs and report) moves to RUN_DIR/previous/TIME/: a
  rerun in the same folder (the default folder is per job id) starts a control plane and a
  record of its own, and loses nothing.
* `hold_storage`: the job's claim on its checkpoint storage (checkpoint/storage_claim.py): one
  live job per directory, and the steps a rerun resumes from; `resume` lists them in the
  job's catalog and makes the job's first event, which says so.

Both hold an `flock` for as long as the launcher runs; the caller closes them when it ends.
This module never deletes a file: it moves an earlier run's files, and the claim deletes steps
only when the user asked (`--fresh --discard-storage`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path

from transom.checkpoint.storage_claim import ANY_JOB, Claim, StorageBusy, adopt, claim
from transom.common import files
from transom.common.records import Event, EventKind
from transom.job_spec import ConfigError
from transom.store import Store

log = logging.getLogger("transom.run")


def hold_run_dir(run_dir: Path) -> int:
    """Hold `run_dir` for this launcher (the lock's file descriptor) and move an earlier run's
    files aside; ConfigError when another `transom run` holds it."""
    fd = os.open(run_dir / files.LAUNCHER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"run directory {run_dir} is in use by another `transom run`; give this one another "
            "--run-dir"
        ) from None
    left = [n for n in files.RUN_STATE if (run_dir / n).exists()]
    if left:
        previous = run_dir / files.PREVIOUS_RUNS / time.strftime("%Y%m%d-%H%M%S")
        previous.mkdir(parents=True, exist_ok=True)
        for name in left:
            os.replace(run_dir / name, previous / name)
        log.warning("an earlier run's files in %s moved to %s", run_dir, previous)
    return fd


def hold_storage(root: Path, job: str, fresh: bool, discard: bool) -> Claim:
    """`job`'s claim on checkpoint storage `root`; ConfigError when another live job holds it
    or it cannot be written."""
    try:
        return claim(root, job, fresh, discard)
    except StorageBusy as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(
            f"checkpoint storage {root} cannot be written: {e.strerror or e}"
        ) from None


def resume(store: Store, held: Claim) -> Event | None:
    """List the steps `held` resumes from in the job's catalog (before the spec is published:
    the first plan restores the newest of them); the event that says so, None when none."""
    adopted = adopt(store, held.root, held.steps)
    if not adopted:
        return None
    whose = "" if held.resumes in (None, ANY_JOB) else f" of job {held.resumes}"
    message = (
        f"resuming from step {adopted[0]}{whose} in {held.root} ({len(adopted)} complete step(s) "
        "there; --fresh starts over)"
    )
    extra = {"resumes": held.resumes, "storage": str(held.root)}
    return Event(
        time.time(), EventKind.CHECKPOINT, message, action="resume", step=adopted[0], extra=extra
    )
