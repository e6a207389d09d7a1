"""Idle priority for background work: it uses only CPU time that nothing else on the machine wants.

Two settings together, because either alone leaks:
- the process's policy is SCHED_IDLE: within its scheduling group it yields to every other task;
- its session's *autogroup* is niced to AUTOGROUP_IDLE_NICE. Where the kernel groups each session
  for fair sharing (CONFIG_SCHED_AUTOGROUP, on by default on most distributions), the CPU is
  first shared between sessions, and a process of a session of its own (a warm interpreter, which
  has one so that its tree can be stopped at once) would get a whole session's share whatever
  its policy: measured here, five SCHED_IDLE interpreters importing torch took 77% of both cores
  while the node's agents, servers and pre-flight checks waited (a plain spinner got 11%).

`enter` and `leave` are best-effort: what the kernel refuses leaves the process as it was. Leaving
SCHED_IDLE needs root or RLIMIT_NICE of at least NICE_CEILING (`can_leave`); an autogroup's nice
may go back to 0 without privileges, but an unprivileged writer is rate-limited machine-wide (one
write per 100 ms: EAGAIN), so a write is retried for AUTOGROUP_RETRY_S.

It must never make a process more urgent than the normal policy and nice 0.
"""

from __future__ import annotations

import errno
import os
import resource
import time

NICE_CEILING = 20  # RLIMIT_NICE needed to leave SCHED_IDLE without privileges (nice 0)
AUTOGROUP_IDLE_NICE = 19
AUTOGROUP_RETRY_S = 0.5


def can_leave() -> bool:
    """Whether a process here may switch from SCHED_IDLE back to the normal policy."""
    return hasattr(os, "SCHED_IDLE") and (
        os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= NICE_CEILING
    )


def enter(pid: int = 0) -> bool:
    """Put process `pid` (0: this one) at idle priority: SCHED_IDLE and its autogroup niced;
    False (and nothing changed) where SCHED_IDLE was refused."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        return False
    set_autogroup_nice(pid, AUTOGROUP_IDLE_NICE)
    return True


def leave(pid: int = 0) -> None:
    """Put process `pid` (0: this one) back at the normal policy and its autogroup at nice 0."""
    try:
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass  # gone, or not allowed: it keeps its policy
    set_autogroup_nice(pid, 0)


def autogroup_nice(pid: int = 0) -> int | None:
    """The nice of `pid`'s autogroup; None where the kernel has none (or the process is gone)."""
    try:
        with open(_autogroup_path(pid)) as f:
            return int(f.read().split()[-1])  # "/autogroup-123 nice 19"
    except (OSError, ValueError, IndexError):
        return None


def set_autogroup_nice(pid: int, nice: int) -> None:
    deadline = time.monotonic() + AUTOGROUP_RETRY_S
    while True:
        try:
            with open(_autogroup_path(pid), "w") as f:
                f.write(str(nice))
            return
        except OSError as e:
            if e.errno != errno.EAGAIN or time.monotonic() >= deadline:
                return  # no autogroups here, gone, or not allowed: it stays as it was
            time.sleep(0.02)


def _autogroup_path(pid: int) -> str:
    return f"/proc/{pid or 'self'}/autogroup"
