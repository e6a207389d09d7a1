"""Process-tree supervision: start children that die with their parent, stop whole trees.

Stopping is SIGTERM to the child's process group and every descendant, then SIGKILL for
what is still alive after a grace period, so no worker, data-loader child or shell wrapper
outlives the job. A tree can also be paused (SIGSTOP) and resumed, or killed at once without
running again (`signal_trees`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable

import psutil

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """preexec_fn: ask the kernel to send this child `signum` (SIGKILL; SIGTERM for one that
    should clean up, through functools.partial) when the thread that forked it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum)
    except OSError:
        pass


def new_session_dying_with_parent(signum: int = signal.SIGKILL) -> None:
    """preexec_fn: own process group (so the tree can be signalled at once) + die with parent
    (by `signum`, as `die_with_parent`)."""
    os.setsid()
    die_with_parent(signum)


def wait_polled(
    poll: Callable[[], int | None], pause: Callable[[float], None], timeout: float | None, pid: int
) -> int:
    """`Popen.wait` for a process known by `poll` (its exit code, None while it runs) that is not
    this process's child: `pause(s)` waits at most s seconds for news; TimeoutExpired after
    `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while (code := poll()) is None:
        left = 0.1 if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired([str(pid)], timeout or 0.0)
        pause(min(left, 0.1))
    return code


def running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie no longer does)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants that exist now."""
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def signal_trees(pids: list[int], signum: int) -> None:
    """Send `signum` to every process of the trees rooted at `pids` (SIGSTOP, SIGCONT, SIGKILL;
    never SIGCONT first, so a paused process killed this way runs no further instruction)."""
    for pid in pids:
        for p in process_tree(pid):
            try:
                p.send_signal(signum)
            except psutil.NoSuchProcess:
                pass


def stop_tree(pids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM every process in the trees rooted at `pids`, SIGKILL survivors after `grace_s`."""
    procs: list[psutil.Process] = []
    for pid in pids:
        procs.extend(process_tree(pid))
    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)  # a stopped (SIGSTOP) process cannot handle SIGTERM
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def stop_process(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop a Popen child and its descendants, and reap it."""
    if process.poll() is None:
        stop_tree([process.pid], grace_s)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
