"""The memory a checkpoint budget is sized from: the machine's, or a smaller cgroup limit."""

from __future__ import annotations

from pathlib import Path

import psutil

from transom.checkpoint.server_options import default_budget
from transom.utils import memory_limit


def _fake_cgroup(root: Path, v1_value: str | None, v2_value: str | None) -> None:
    """This process's cgroup directories under `root`, with the given limits."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "" and v2_value is not None:
            d = root / path.lstrip("/")
            d.mkdir(parents=True, exist_ok=True)
            (d / "memory.max").write_text(v2_value + "\n")
        elif "memory" in controllers.split(",") and v1_value is not None:
            d = root / "memory" / path.lstrip("/")
            d.mkdir(parents=True, exist_ok=True)
            (d / "memory.limit_in_bytes").write_text(v1_value + "\n")


def test_a_cgroup_limit_is_read_and_no_limit_is_none(tmp_path):
    _fake_cgroup(tmp_path / "a", "2147483648", "2147483648")
    assert memory_limit.cgroup_limit(tmp_path / "a") == 2 << 30
    _fake_cgroup(tmp_path / "b", "9223372036854771712", "max")  # what "no limit" looks like
    assert memory_limit.cgroup_limit(tmp_path / "b") is None
    assert memory_limit.cgroup_limit(tmp_path / "none") is None


def test_the_default_budget_is_half_of_what_this_process_may_use():
    usable = memory_limit.usable_memory()
    assert usable <= psutil.virtual_memory().total
    assert default_budget() == usable // 2
