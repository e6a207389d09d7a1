"""A job takes its storage directory: never beside another live job, and resuming what it holds.

`claim(root, job)` runs once per launcher before the job is planned (launcher.py, on one machine,
with --store and under Slurm alike):

* **One live job per directory.** Every launcher of a live job holds a shared `flock` on
  `.jobs/<job>.lock` for as long as it runs (the lock goes with the process, however it dies). A
  claim, under the directory's lock (storage.py's `.lock`), tries each other job's lock file: one
  still held is a live job, and the claim is refused (`StorageBusy`, a clear error); one nobody
  holds is a dead job's and is removed. Launchers of the same job share their lock.
* **Rerun = resume.** `owner.json` names the job that last claimed the directory and the job it
  resumed from. A new job resumes from the previous owner's complete steps, or, when that one
  saved none, from what it resumed from itself (a chain of reruns goes on from the newest
  steps, whatever the job ids). A directory without `owner.json` (written before this existed)
  is resumed from all its complete steps. `fresh` resumes nothing: the old steps stay (retention
  removes another job's steps only once this job has K newer ones, storage.py), unless
  `discard` also removes every step folder, the one path that deletes another job's steps, and
  only because the user asked.

The caller lists `Claim.steps` in the job's catalog (`adopt`) so that its controller restores
the newest restorable of them, exactly as if the job had persisted them itself.

`owner.json` is read as untrusted input (another job, or a person, wrote it): a malformed one is
treated as absent. This module never writes a shard or a manifest, and deletes step folders
only with `discard`.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from transom.checkpoint import catalog, storage
from transom.common.names import BadId, check_id, valid_id
from transom.common.record_base import Record, RecordError
from transom.common.states import Tier
from transom.store import Store

OWNER = "owner.json"
JOBS = ".jobs"  # one lock file per job that claimed the directory: <job>.lock
ADOPTED_NODE = "storage"  # the catalog's `node` of an adopted shard: no node of this job wrote it
# `resumes` of a directory written before owner.json existed: every job's complete steps.
ANY_JOB = "*"


class StorageBusy(RuntimeError):
    """Another live job holds the storage directory."""


@dataclass
class StorageOwner(Record):
    """`owner.json`: the job that last claimed a storage directory."""

    job: str
    resumes: str | None = None  # the job whose steps it resumed from (None: it started fresh)
    claimed_at: float = 0.0
    host: str = ""
    pid: int = 0


@dataclass
class Claim:
    """A job's hold on its storage directory (release it when the job's launcher ends)."""

    root: Path
    job: str
    resumes: str | None  # the job whose complete steps this one resumes from
    steps: list[int] = field(default_factory=list)  # those steps, newest first
    lock_fd: int | None = None

    def release(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # the flock goes with it
            self.lock_fd = None


def claim(root: Path, job: str, fresh: bool = False, discard: bool = False) -> Claim:
    """Take `root` for `job` (see the module's docstring); StorageBusy when another live job
    holds it, OSError when it cannot be created or written."""
    root = Path(root)
    jobs = root / JOBS
    jobs.mkdir(parents=True, exist_ok=True)
    with storage.locked(root):
        for lock in sorted(jobs.glob("*.lock")):
            other = lock.name.removesuffix(".lock")
            if not valid_id(other):
                continue  # not a job's lock: nothing of ours, and not a name to print
            if other != job and _held(lock):
                raise StorageBusy(
                    f"checkpoint storage {root} is in use by job {other}, which is still "
                    "running; stop it, or give this job another --ckpt-storage"
                )
            if other != job:
                lock.unlink(missing_ok=True)  # a dead job's
        mine = jobs / f"{job}.lock"
        joining = _held(mine)  # another machine of this job, running: it claimed already
        fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            previous = read_owner(root)
            if discard and not joining:
                _discard_all(root)
            if fresh or discard:
                resumes = None
            elif previous is None:
                resumes = None if not storage.complete_steps(root) else ANY_JOB
            elif previous.job == job:  # this job again, or another machine of it
                resumes = job if _steps_of(root, job) else previous.resumes
            else:
                resumes = previous.job if _steps_of(root, previous.job) else previous.resumes
            owner = StorageOwner(job, resumes, time.time(), socket.gethostname(), os.getpid())
            storage.atomic_write(root / OWNER, [json.dumps(owner.to_dict(), indent=1).encode()])
        except BaseException:
            os.close(fd)
            raise
    found = [] if resumes is None else _steps_of(root, None if resumes == ANY_JOB else resumes)
    return Claim(root, job, resumes, found, fd)


def read_owner(root: Path) -> StorageOwner | None:
    """The directory's owner record; None when there is none or it is not a valid one."""
    try:
        owner = StorageOwner.from_dict(json.loads((Path(root) / OWNER).read_text()))
        check_id("owner.json job", owner.job)
    except (OSError, ValueError, RecordError, BadId):
        return None
    return owner


def _held(lock: Path) -> bool:
    """Whether some process holds `lock` (a live job's launcher)."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _steps_of(root: Path, job: str | None) -> list[int]:
    """Complete steps whose manifest names `job` (None: every job's), newest first."""
    steps = storage.complete_steps(root)
    return steps if job is None else [s for s in steps if storage.manifest_job(root, s) == job]


def _discard_all(root: Path) -> None:
    """Remove every step folder and `latest` (--fresh --discard-storage)."""
    for entry in root.iterdir():
        if storage.STEP_RE.match(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
    (root / storage.LATEST).unlink(missing_ok=True)


def adopt(store: Store, root: Path, steps: list[int]) -> list[int]:
    """List `steps` of `root` in `store`'s catalog as held by the storage tier; returns those
    listed, newest first. A step whose manifest does not parse, or lacks a rank's shard file,
    is skipped. It must run before any controller plans a generation (before the job spec is
    published)."""
    adopted = []
    for step in steps:
        manifest = storage.read_manifest(root, step)
        world_size = manifest.world_size if manifest is not None else None
        if world_size is None:
            continue
        paths = [storage.shard_path(root, step, rank) for rank in range(world_size)]
        if not all(p.is_file() for p in paths):
            continue
        for rank, path in enumerate(paths):
            listing = catalog.Listing(
                step,
                rank,
                Tier.STORAGE,
                world_size=world_size,
                node=ADOPTED_NODE,
                nbytes=path.stat().st_size,
                path=str(path),
            )
            catalog.publish(store, catalog.STORAGE_HOLDER, listing)
        adopted.append(step)
    return adopted
