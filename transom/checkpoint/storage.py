"""The storage tier: shard files in a directory (local disk or a shared file system).

Layout of a storage directory:
    step_000000000012/rank_000003.shard   one shard: prefix + header + data (see layout.py)
    step_000000000012/manifest.json       written last, once every rank's shard is there
    latest                                the newest step with a manifest (text, one integer)
    .lock                                 serialises manifest, `latest` and retention among writers

Every file is written to a temporary name, fsynced, renamed into place, and its directory
fsynced, so a crash at any moment leaves either the old state or the new one, never a file that
looks complete but is not; a torn shard is also caught by its checksums when loaded. Several
servers (one per node) write into one directory; the one that completes a step writes its
manifest. This module never deletes a step that is newer than the K newest complete ones.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from transom.checkpoint import layout
from transom.checkpoint.shm import anonymous_buffer, as_bytes

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


def atomic_write(path: Path, parts) -> None:
    """Write `parts` (bytes-like, in order) to `path` durably: a temporary file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                for i in range(0, len(part), WRITE_BLOCK):
                    f.write(part[i : i + WRITE_BLOCK])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


@contextmanager
def _locked(root: Path):
    with open(root / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_shard(root: Path, step: int, rank: int, header_bytes: bytes, data: memoryview) -> Path:
    """Write one shard durably; OSError when the disk is full or not writable."""
    directory = step_dir(root, step)
    directory.mkdir(parents=True, exist_ok=True)
    path = shard_path(root, step, rank)
    atomic_write(path, [header_bytes, data])
    return path


def read_shard(
    path: Path, step: int | None = None, rank: int | None = None
) -> tuple[dict, torch.Tensor]:
    """(header, data as a uint8 tensor) of a shard file, checksums verified; ShardError when bad."""
    try:
        with open(path, "rb") as f:
            head = f.read(layout.PREFIX.size)
            header_len, _, data_len = layout.decode_prefix(head)
            span = layout.header_span(header_len)
            head += f.read(span - len(head))
            header, offset = layout.decode_header(head)
            layout.check_identity(header, step, rank)
            size = os.fstat(f.fileno()).st_size
            if size != offset + data_len:
                raise layout.ShardError(
                    f"shard file {path} has {size} bytes, expected {offset + data_len}: truncated"
                )
            buf = anonymous_buffer(data_len)
            view = memoryview(buf)[:data_len]
            f.seek(offset)
            got = 0
            while got < data_len:
                n = f.readinto(view[got : got + WRITE_BLOCK])
                if not n:
                    raise layout.ShardError(f"shard file {path} is truncated")
                got += n
    except FileNotFoundError as e:
        raise layout.ShardError(f"shard file {path} does not exist") from e
    layout.verify_data(header, view)
    del view
    return header, as_bytes(buf)[:data_len]


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


def read_manifest(root: Path, step: int) -> dict | None:
    try:
        return json.loads((step_dir(root, step) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def complete_step(root: Path, step: int, world_size: int, keep: int) -> list[int]:
    """If every rank's shard of `step` is on disk, write its manifest and `latest`; apply retention.

    Returns the steps removed by retention.
    """
    root = Path(root)
    with _locked(root):
        if (step_dir(root, step) / MANIFEST).exists():
            return []
        ranks = shard_ranks(root, step)
        if ranks != set(range(world_size)):
            return []
        manifest = {
            "step": step,
            "world_size": world_size,
            "time": time.time(),
            "shards": {str(r): shard_path(root, step, r).stat().st_size for r in sorted(ranks)},
        }
        atomic_write(step_dir(root, step) / MANIFEST, [json.dumps(manifest, indent=1).encode()])
        complete = complete_steps(root)
        atomic_write(root / LATEST, [f"{complete[0]}\n".encode()])
        return _retain(root, complete, keep)


def _retain(root: Path, complete: list[int], keep: int) -> list[int]:
    """Remove every step folder older than the `keep` newest complete steps."""
    if len(complete) <= keep:
        return []
    oldest_kept = complete[keep - 1]
    removed = []
    for entry in root.iterdir():
        m = STEP_RE.match(entry.name)
        if m and int(m.group(1)) < oldest_kept:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(int(m.group(1)))
    return sorted(removed)


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
