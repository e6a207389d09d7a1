"""How much memory this process may use: the machine's, or less where a cgroup limits it.

In a container (a Kubernetes pod, a Slurm job with cgroup confinement) the machine's total is
not what the process can use: the memory cgroup's limit is, and a checkpoint budget sized from
the machine's total would get the container OOM-killed. `usable_memory()` is the smaller of the
two. It reads the limit of this process's own cgroup (v2 `memory.max`, v1
`memory.limit_in_bytes`); "no limit" and anything unreadable mean the machine's total. This
module only reads files: it never changes a limit.
"""

from __future__ import annotations

from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _own_cgroup_dirs(root: Path) -> list[Path]:
    """The memory cgroup directories of this process, own first (v2 unified, then v1)."""
    dirs = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        relative = path.lstrip("/")
        if controllers == "":  # cgroup v2
            dirs += [root / relative, root]
        elif "memory" in controllers.split(","):
            dirs += [root / "memory" / relative, root / "memory"]
    return dirs


def cgroup_limit(root: Path = CGROUP_ROOT) -> int | None:
    """This process's memory cgroup limit in bytes; None when there is none (or unreadable)."""
    for directory in _own_cgroup_dirs(root):
        for name in ("memory.max", "memory.limit_in_bytes"):
            try:
                text = (directory / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < (1 << 60):  # v1 says "no limit" with a huge number
                return int(text)
            return None  # "max" (v2) or an unlimited v1 value: this cgroup sets no limit
    return None


def usable_memory() -> int:
    """The machine's memory, or the cgroup's limit when that is smaller."""
    total = psutil.virtual_memory().total
    limit = cgroup_limit()
    return min(total, limit) if limit else total
