"""Pre-flight checks a node runs before it first trains in a job.

Cheap checks that catch a node that would fail anyway: the run directory takes a write and an
fsync, there is free disk and memory, and the training script is readable. A failed check is
reported to the controller, which evicts the node before it costs a restart.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

MIN_FREE_DISK_BYTES = 256 << 20
MIN_FREE_MEMORY_BYTES = 256 << 20


def preflight(run_dir: Path, script: str) -> tuple[bool, dict]:
    """(passed, evidence) for this node."""
    evidence: dict = {}
    problems: list[str] = []
    start = time.perf_counter()
    try:
        probe = Path(run_dir) / f".preflight-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
        evidence["disk_write_s"] = round(time.perf_counter() - start, 4)
    except OSError as e:
        problems.append(f"run directory not writable: {e.strerror or e}")
    try:
        free_disk = psutil.disk_usage(str(run_dir)).free
        evidence["free_disk_bytes"] = free_disk
        if free_disk < MIN_FREE_DISK_BYTES:
            problems.append(f"only {free_disk >> 20} MiB of disk free")
    except OSError as e:
        problems.append(f"cannot read disk usage: {e}")
    free_memory = psutil.virtual_memory().available
    evidence["free_memory_bytes"] = free_memory
    if free_memory < MIN_FREE_MEMORY_BYTES:
        problems.append(f"only {free_memory >> 20} MiB of memory free")
    if not os.access(script, os.R_OK):
        problems.append(f"script {script} is not readable on this node")
    evidence["problems"] = problems
    return not problems, evidence
