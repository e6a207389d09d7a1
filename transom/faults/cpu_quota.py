"""A fault that slows a worker with a real CPU quota: quota (a cgroup's CFS bandwidth limit).

Where a container runtime or a noisy neighbour's share caps a rank's CPU, the kernel's CFS
bandwidth controller lets it run `quota` microseconds of each `period` and then holds it until the
next period: a finer, smoother shape than the SIGSTOP/SIGCONT duty cycle of `throttle`, and the one
a Kubernetes CPU limit makes. The agent creates a cgroup of its own under the cpu controller
(cgroup v1 `cpu/`, or cgroup v2 with `cpu` enabled), measures the CPU the worker used over
USAGE_WINDOW_S, sets the quota to 1/FACTOR of that (a rank that uses a fifth of a CPU is not
slowed by a cap of half of one), moves the worker (all its threads) into the cgroup, and removes
the cgroup once the worker is gone.
It needs a writable cpu cgroup (root, or a delegated subtree): `available()` says whether there
is one, and the schedule refuses the fault where there is none.

This module must never move a process other than the target worker, nor touch a cgroup it did
not create.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from transom.common import anomaly_types
from transom.faults.fault_type import AGENT, AgentTarget, Fault, FaultType

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000  # the CFS bandwidth controller's default period
WATCH_S = 0.2  # how often the cleanup thread looks for the worker's end
USAGE_WINDOW_S = 1.0  # the worker's CPU use measured over this long before it is capped
MIN_QUOTA_US = 1000  # the kernel's smallest quota


def cpu_hierarchy() -> tuple[Path, bool] | None:
    """The writable cpu cgroup directory to create children in, and whether it is cgroup v2;
    None when there is none."""
    v1 = CGROUP_ROOT / "cpu"
    if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
        return v1, False
    controllers = CGROUP_ROOT / "cgroup.subtree_control"
    try:
        if "cpu" in controllers.read_text().split() and os.access(CGROUP_ROOT, os.W_OK):
            return CGROUP_ROOT, True
    except OSError:
        pass
    return None


def available() -> bool:
    return cpu_hierarchy() is not None


def cpu_use(pid: int, window_s: float = USAGE_WINDOW_S) -> float:
    """The CPUs `pid` used over the next `window_s` (0.5: half of one)."""
    process = psutil.Process(pid)
    before = sum(process.cpu_times()[:2])
    time.sleep(window_s)
    return max(0.0, sum(process.cpu_times()[:2]) - before) / window_s


def limit(pid: int, cpus: float, name: str) -> Path:
    """Cap `pid` to `cpus` CPUs in a new cgroup `name` (its path). OSError when the cgroup cannot
    be made."""
    found = cpu_hierarchy()
    if found is None:
        raise OSError("no writable cpu cgroup (cgroup v1 cpu/ or v2 with cpu enabled)")
    root, v2 = found
    group = root / name
    group.mkdir(exist_ok=True)
    quota = max(MIN_QUOTA_US, int(PERIOD_US * cpus))
    try:
        if v2:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(pid))
    except OSError:
        remove(group)
        raise
    return group


def cap(
    pid: int,
    factor: float,
    name: str,
    took_hold: Callable[[float, str | None], None] = lambda when, failure: None,
) -> threading.Thread:
    """In a thread: measure what `pid` uses, cap it to 1/`factor` of that (then
    `took_hold(time, None)`), and remove the cgroup once the process is gone. A failure is logged
    and given to `took_hold`: a fault that cannot be played must not take the agent down."""

    def run() -> None:
        try:
            group = limit(pid, cpu_use(pid) / factor, name)
        except (OSError, psutil.Error) as e:
            log.warning("could not cap worker %d: %s", pid, e)
            took_hold(time.time(), f"could not cap worker {pid}: {e}")
            return
        took_hold(time.time(), None)
        log.info("worker %d capped in %s", pid, group)
        while Path(f"/proc/{pid}").exists() and _members(group):
            time.sleep(WATCH_S)
        remove(group)

    thread = threading.Thread(target=run, name=f"transom-quota-{pid}", daemon=True)
    thread.start()
    return thread


def _members(group: Path) -> bool:
    try:
        return bool((group / "cgroup.procs").read_text().split())
    except OSError:
        return False


def remove(group: Path) -> None:
    """rmdir the cgroup once empty (a process still exiting keeps it busy a moment)."""
    for _ in range(50):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(WATCH_S)
    log.warning("could not remove the cgroup %s", group)


class CpuQuota(FaultType):
    """From its step on (and USAGE_WINDOW_S), the rank gets 1/FACTOR of the CPU it used (a cgroup
    CFS quota)."""

    name = "quota"
    where = AGENT
    detected_by = (anomaly_types.STRAGGLER,)
    description = "a worker is capped by a cgroup quota to 1/FACTOR of the CPU it used"
    holds_later = True  # USAGE_WINDOW_S after it fires

    def note(self, fault: Fault) -> str:
        return f" (capped to 1/{fault.factor:g} of the CPU it used)"

    def validate(self, fault: Fault) -> str | None:
        if fault.factor <= 1.0:
            return "factor must be above 1"
        return None if available() else "needs a writable cpu cgroup on this machine"

    def fire_agent(self, fault: Fault, target: AgentTarget) -> None:
        cap(target.pid, float(fault.factor), f"transom-{fault.id}-{target.pid}", target.took_hold)

    def describe(self, fault: Fault) -> str:
        return f"a worker is capped by a cgroup quota to 1/{fault.factor:g} of the CPU it used"
