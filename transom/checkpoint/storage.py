"""The storage tier: shard files in a directory (local disk or a shared file system).

Layout of a storage directory:
    step_000000000012/rank_000003.shard   one shard: prefix + header + data (see shard_format.py)
    step_000000000012/manifest.json       written last, once every rank's shard is there, all of
                                          one timeline (job, generation, world size)
    latest                                the newest step with a manifest (text, one integer)
    .lock                                 serialises manifest, `latest` and retention among writers

Every file is written to a temporary name, fsynced, renamed into place, and its directory
fsynced, so a crash at any moment leaves either the old state or the new one, never a file that
looks complete but is not; a torn shard is also caught by its checksums when loaded. Several
servers (one per node) write into one directory; the one that completes a step writes its
manifest. A manifest names its timeline and covers only shards of that timeline: a shard of a
newer timeline written into a complete step withdraws the old manifest first (the step is being
re-saved after a fresh start or a rollback); one of an older generation is refused
(`StaleTimeline`); a read checks the shard against its step's manifest (read, as every
manifest is, into a `Manifest` whose fields are checked: another server or a person wrote it).
Steps discarded as poisoned are removed (`discard_steps`), and retention keeps the K newest
complete steps of the job that writes; both act on that job's own timeline only. Another job's
steps (a directory a rerun resumes from: storage_claim.py) are never discarded, and leave only
once the writing job has K complete steps newer than them.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from transom.checkpoint import shard_format
from transom.checkpoint.reshard_steps import reshardable
from transom.checkpoint.saved_by import UNKNOWN, saved_by
from transom.checkpoint.shard_format import ShardHeader, Timeline
from transom.checkpoint.shm import anonymous_buffer

STEP_RE = re.compile(r"^step_(\d{12})$")
SHARD_RE = re.compile(r"^rank_(\d{6})\.shard$")
MANIFEST = "manifest.json"
LATEST = "latest"
WRITE_BLOCK = 16 << 20


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:012d}"


def shard_path(root: Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank_{rank:06d}.shard"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: Path, parts: Iterable[bytes | memoryview], between: Callable[[], None] | None = None
) -> None:
    """Write `parts` (bytes-like, in order) to `path` durably: a temporary file, fsync, rename.
    `between` is called before each WRITE_BLOCK but a part's first (the persister waits there
    while a worker copies a save: both would share the node's memory bandwidth)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                for i in range(0, len(part), WRITE_BLOCK):
                    if i and between is not None:
                        between()
                    f.write(part[i : i + WRITE_BLOCK])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


@contextmanager
def locked(root: Path) -> Iterator[None]:
    with open(root / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class StaleTimeline(OSError):
    """A shard of an older generation than the complete step it would be written into."""


def _older(a: Timeline | None, b: Timeline | None) -> bool:
    """Whether timeline `a` is of an older generation of the same job than `b`."""
    return a is not None and b is not None and a.job == b.job and a.generation < b.generation


def write_shard(
    root: Path,
    step: int,
    rank: int,
    header_bytes: bytes,
    data: memoryview,
    timeline: Timeline | None = None,
    between: Callable[[], None] | None = None,
) -> Path:
    """Write one shard durably; OSError when the disk is full or not writable, StaleTimeline when
    `step` is complete under a newer generation, or its file of `rank` is of one. A complete step
    of another timeline stops being complete (its manifest is withdrawn) before the shard
    replaces one of its files."""
    directory = step_dir(root, step)
    directory.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(root, step)
    if manifest is not None and manifest.timeline != timeline:
        with locked(Path(root)):
            manifest = read_manifest(root, step)
            if manifest is not None and manifest.timeline != timeline:
                if _older(timeline, manifest.timeline):
                    raise StaleTimeline(
                        f"step {step} is complete under {manifest.timeline}; a shard of "
                        f"the older {timeline} is not written over it"
                    )
                (directory / MANIFEST).unlink(missing_ok=True)
                _write_latest(Path(root))
    path = shard_path(root, step, rank)
    on_disk = _timeline_of(path) if path.exists() else None
    if _older(timeline, on_disk):  # a zombie persisting late over the newer generation's shard
        raise StaleTimeline(
            f"step {step} rank {rank} on disk is of {on_disk}; a shard of the older {timeline} "
            "is not written over it"
        )
    atomic_write(path, [header_bytes, data], between)
    return path


def read_shard(
    path: Path, step: int | None = None, rank: int | None = None
) -> tuple[ShardHeader, memoryview]:
    """(header, data) of a shard file, checksums verified; ShardError when bad. The data is a
    view of private memory holding exactly the shard's data (layout.rebuild takes it as is)."""
    try:
        with open(path, "rb") as f:
            head = f.read(shard_format.PREFIX.size)
            header_len, _, data_len = shard_format.decode_prefix(head)
            span = shard_format.header_span(header_len)
            head += f.read(span - len(head))
            header, offset = shard_format.decode_header(head)
            shard_format.check_identity(header, step, rank)
            _check_manifest(Path(path), header)
            size = os.fstat(f.fileno()).st_size
            if size != offset + data_len:
                raise shard_format.ShardError(
                    f"shard file {path} has {size} bytes, expected {offset + data_len}: truncated"
                )
            buf = anonymous_buffer(data_len)
            view = memoryview(buf)[:data_len]
            f.seek(offset)
            got = 0
            while got < data_len:
                n = f.readinto(view[got : got + WRITE_BLOCK])
                if not n:
                    raise shard_format.ShardError(f"shard file {path} is truncated")
                got += n
    except FileNotFoundError as e:
        raise shard_format.ShardError(f"shard file {path} does not exist") from e
    shard_format.verify_data(header, view)
    return header, view


def _check_manifest(path: Path, header: ShardHeader) -> None:
    """ShardError when `path`'s step has a manifest of another timeline than the shard's, or one
    whose timeline is not valid (a manifest that names none, or that this code cannot read,
    checks nothing)."""
    manifest = _manifest_at(path.parent / MANIFEST)
    if manifest is not None and manifest.bad_timeline:
        raise shard_format.ShardError(f"the manifest of {path.parent} names no valid timeline")
    if manifest is not None and manifest.timeline is not None:
        shard_format.check_timeline(header, manifest.timeline)


def read_header(path: Path) -> ShardHeader:
    """The header of a shard file (no data read, no checksum of the data); ShardError when bad."""
    with open(path, "rb") as f:
        head = f.read(shard_format.PREFIX.size)
        header_len, _, _ = shard_format.decode_prefix(head)
        head += f.read(shard_format.header_span(header_len) - len(head))
    return shard_format.decode_header(head)[0]


def complete_steps(root: Path) -> list[int]:
    """Steps with a manifest, newest first."""
    if not Path(root).is_dir():
        return []
    steps = []
    for entry in Path(root).iterdir():
        m = STEP_RE.match(entry.name)
        if m and (entry / MANIFEST).exists():
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


def shard_ranks(root: Path, step: int) -> set[int]:
    directory = step_dir(root, step)
    if not directory.is_dir():
        return set()
    return {int(m.group(1)) for e in directory.iterdir() if (m := SHARD_RE.match(e.name))}


@dataclass(frozen=True)
class Manifest:
    """What a complete step's manifest says to its readers: the size of the world that saved
    it and its timeline (None where the file has none of the right type: it may be corrupt),
    and whether it names a timeline that is not valid (`bad_timeline`: a shard read under it is
    refused)."""

    world_size: int | None
    timeline: Timeline | None
    bad_timeline: bool = False

    @classmethod
    def parse(cls, value: object) -> Manifest | None:
        """The manifest in a decoded JSON value (a file another server, or a person, wrote:
        every field checked); None when it is not a JSON object."""
        if not isinstance(value, dict):
            return None
        world_size, named = value.get("world_size"), value.get("timeline")
        timeline = Timeline.parse(named)
        return cls(
            world_size if type(world_size) is int and world_size >= 1 else None,
            timeline,
            named is not None and timeline is None,
        )


def _manifest_at(path: Path) -> Manifest | None:
    """The manifest file at `path`; None when it is missing, unreadable or not a JSON object."""
    try:
        return Manifest.parse(json.loads(path.read_text()))
    except (OSError, ValueError, RecursionError):
        return None


def read_manifest(root: Path, step: int) -> Manifest | None:
    """`step`'s manifest; None when it has none (or one that is not a JSON object)."""
    return _manifest_at(step_dir(root, step) / MANIFEST)


def _same_timeline(root: Path, step: int, ranks: set[int], timeline: Timeline | None) -> bool:
    for rank in ranks:
        try:
            if read_header(shard_path(root, step, rank)).timeline != timeline:
                return False
        except (OSError, shard_format.ShardError):
            return False
    return True


def complete_step(
    root: Path, step: int, world_size: int, keep: int, timeline: Timeline | None = None
) -> dict[int, list[int]]:
    """If every rank's shard of `step` is on disk, all of `timeline`, write its manifest and
    `latest`; apply retention (to `timeline`'s job: `_retain`). A file of a rank beyond the
    world (left by another world that never completed the step) is not part of the step.

    Returns the steps removed by retention, each with the ranks whose shards it held.
    """
    root = Path(root)
    with locked(root):
        if (step_dir(root, step) / MANIFEST).exists():
            return {}
        ranks = set(range(world_size))
        if not ranks <= shard_ranks(root, step) or not _same_timeline(root, step, ranks, timeline):
            return {}
        manifest = {
            "step": step,
            "world_size": world_size,
            "timeline": None if timeline is None else timeline.to_json(),
            "time": time.time(),
            "shards": {str(r): shard_path(root, step, r).stat().st_size for r in sorted(ranks)},
        }
        atomic_write(step_dir(root, step) / MANIFEST, [json.dumps(manifest, indent=1).encode()])
        complete = _write_latest(root)
        return _retain(root, complete, keep, job_of(timeline))


def _write_latest(root: Path) -> list[int]:
    """Point `latest` at the newest complete step (remove it when there is none); the complete
    steps, newest first (lock held)."""
    complete = complete_steps(root)
    if complete:
        atomic_write(root / LATEST, [f"{complete[0]}\n".encode()])
    else:
        (root / LATEST).unlink(missing_ok=True)
    return complete


def discard_steps(root: Path, first_bad_step: int, generation: int, job: str) -> list[int]:
    """Remove what `job`'s generations before `generation` wrote of steps >= `first_bad_step`
    (an abandoned history: see catalog.discard_poisoned): their shard files and manifests; the
    steps touched. A file of another job, or one that names no timeline or cannot
    be read, is never removed: a discard acts on `job`'s own timeline only (a rerun's restore
    step must not cost the job it resumed from its later steps)."""
    root = Path(root)
    if not root.is_dir():
        return []
    touched = []
    with locked(root):
        for entry in root.iterdir():
            m = STEP_RE.match(entry.name)
            if not m or int(m.group(1)) < first_bad_step:
                continue
            old = [
                f
                for f in entry.iterdir()
                if (SHARD_RE.match(f.name) or f.name == MANIFEST)
                and UNKNOWN < saved_by(_timeline_of(f), job) < generation
            ]
            if not old:
                continue
            # The step is no longer complete. Its manifest is `job`'s: a shard of `job` written
            # into another timeline's complete step withdrew that one's manifest first.
            (entry / MANIFEST).unlink(missing_ok=True)
            for f in old:
                f.unlink(missing_ok=True)
            if not any(entry.iterdir()):
                entry.rmdir()
            touched.append(int(m.group(1)))
        if touched:
            _write_latest(root)
    return sorted(touched)


def _timeline_of(path: Path) -> Timeline | None:
    """The timeline a shard file's header or a manifest names (None when unreadable)."""
    try:
        if path.name == MANIFEST:
            manifest = _manifest_at(path)
            return manifest.timeline if manifest is not None else None
        return read_header(path).timeline
    except (OSError, ValueError, RecursionError):  # ShardError is a ValueError
        return None


def job_of(timeline: Timeline | None) -> str | None:
    """The job a timeline names (None: none)."""
    return None if timeline is None else timeline.job


def manifest_job(root: Path, step: int) -> str | None:
    """The job whose timeline `step`'s manifest names (None: none, or no readable manifest)."""
    manifest = read_manifest(root, step)
    return job_of(manifest.timeline) if manifest is not None else None


def _retain(root: Path, complete: list[int], keep: int, job: str | None) -> dict[int, list[int]]:
    """Remove every step folder older than `job`'s `keep` newest complete steps (all complete
    steps' when `job` is None); the steps removed, each with the ranks whose shards it held.
    Another job's step newer than those stays: a job resumed from it, or started over beside
    it, has not saved K newer steps of its own yet."""
    mine = complete if job is None else [s for s in complete if manifest_job(root, s) == job]
    if len(mine) <= keep:
        return {}
    oldest_kept = mine[keep - 1]
    removed = {}
    for entry in root.iterdir():
        m = STEP_RE.match(entry.name)
        if m and (step := int(m.group(1))) < oldest_kept:
            removed[step] = sorted(shard_ranks(root, step))
            shutil.rmtree(entry, ignore_errors=True)
    return dict(sorted(removed.items()))


def restorable_steps(root: Path, world_size: int) -> list[int]:
    """Complete steps in a storage directory restorable for `world_size` (saved by that world,
    or by another whose rank 0 shard carries a resharding record), newest first."""
    out = []
    for step in complete_steps(root):
        manifest = read_manifest(root, step)
        saved = manifest.world_size if manifest is not None else None
        if saved == world_size or (
            saved is not None and reshardable(_header_or_none(shard_path(root, step, 0)))
        ):
            out.append(step)
    return out


def _header_or_none(path: Path) -> ShardHeader | None:
    """A shard file's header; None when it is missing or unreadable."""
    try:
        return read_header(path)
    except (OSError, shard_format.ShardError):
        return None


def latest_step(root: Path) -> int | None:
    """The newest complete step: `latest` if it names a complete step, else a scan."""
    try:
        step = int((Path(root) / LATEST).read_text().strip())
        if (step_dir(root, step) / MANIFEST).exists():
            return step
    except (OSError, ValueError):
        pass
    steps = complete_steps(root)
    return steps[0] if steps else None
