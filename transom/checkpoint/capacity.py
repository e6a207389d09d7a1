"""How much shared memory a checkpoint server can really have: the limits of the machine it is on.

The budget a server runs with is the smallest of the configured budget, the free space of the
file system its regions live on (/dev/shm: a tmpfs, often 64 MiB in a container) and the memory
limit of its cgroup (v2 `memory.max` of its cgroup and every parent; v1
`memory.limit_in_bytes`), each named in the one-line reason a refused save gives. This module
only reads limits; it never allocates, and a limit it cannot read is no limit.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as a huge number (the page-aligned maximum of a signed 64-bit int).
V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class Limit:
    nbytes: int
    source: str  # what sets it, for people: "--memory", "free space of /dev/shm", ...


def shm_free(directory: Path) -> int | None:
    """Free bytes of the file system holding `directory` (its nearest existing parent)."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def cgroup_memory_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path | None = None) -> int | None:
    """This process's cgroup memory limit in bytes (the tightest along its path), None when
    there is none or it cannot be read."""
    proc_cgroup = proc_cgroup or Path(f"/proc/{os.getpid()}/cgroup")
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # v2: memory.max along the path
            here = root / rel
            while True:
                value = _read_int(here / "memory.max")
                if value is not None:
                    limits.append(value)
                if here == root or root not in here.parents:
                    break
                here = here.parent
        elif "memory" in controllers.split(","):  # v1
            for base in (root / "memory" / rel, root / "memory"):
                value = _read_int(base / "memory.limit_in_bytes")
                if value is not None and value < V1_UNLIMITED:
                    limits.append(value)
                    break
    return min(limits) if limits else None


def limits(configured: int, shm_dir: Path) -> list[Limit]:
    """Every limit that applies to a server whose regions live in `shm_dir`."""
    found = [Limit(configured, "the configured checkpoint memory budget")]
    free = shm_free(shm_dir)
    if free is not None:
        found.append(Limit(free, f"free space of {Path(shm_dir).parent}"))
    cgroup = cgroup_memory_limit()
    if cgroup is not None:
        found.append(Limit(cgroup, "the cgroup memory limit"))
    return found


def effective_budget(configured: int, shm_dir: Path) -> Limit:
    """The smallest limit: what the server may hold, and what sets it."""
    return min(limits(configured, shm_dir), key=lambda limit: limit.nbytes)
