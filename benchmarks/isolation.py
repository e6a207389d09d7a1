"""Cores of their own for the ranks: what `python -m benchmarks.job_overhead --isolate-ranks` pins.

A real node gives its ranks cores that the launcher and its helpers do not use; on a small
machine where everything shares every core, whatever the control plane uses is taken from the
ranks, which measures the machine more than the system. Here the last `ranks` cores are the
ranks' (one each) and the others everyone else's: the job is started with the others as its
affinity (every process it starts inherits them: etcd, agents, controllers, checkpoint servers,
warm interpreters, torchrun), and `RankPinner` moves each rank, every thread of it, to a core of
its own as soon as it appears (a rank is found by its command line, `overhead.kind_of`, which a
warm interpreter that takes a rank also shows). The same for torchrun and for Transom, so the
pairs compare the systems, not the pinning. On 2 cores: 1 rank on core 1, the rest on core 0.

It only changes the CPU affinity of the processes of the job it was given (and of the benchmark
itself, `use_rest`); it must never change what a job runs, nor pin a process outside that job.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil

from transom.control.warm import TITLE as WARM_TITLE

PIN_EVERY_S = 0.05  # how soon a new rank (or a new thread of one) is moved to its core


@dataclass(frozen=True)
class Cores:
    """Which cores the ranks get (one each) and which everything else gets."""

    ranks: tuple[int, ...]
    rest: tuple[int, ...]

    def to_dict(self) -> dict[str, list[int]]:
        return {"rank_cores": list(self.ranks), "rest_cores": list(self.rest)}


def ranks_for(available: Sequence[int]) -> int:
    """How many ranks get a core of their own: half the cores, at least 1 (on 2 cores: 1)."""
    return max(1, len(available) // 2)


def split(available: Sequence[int], ranks: int) -> Cores:
    """The last `ranks` of `available` cores for the ranks, the others for the rest (ValueError
    if that leaves the rest no core)."""
    cores = sorted(available)
    if ranks < 1 or len(cores) <= ranks:
        raise ValueError(f"{ranks} ranks on cores of their own need more than {len(cores)} cores")
    return Cores(tuple(cores[-ranks:]), tuple(cores[:-ranks]))


def use_rest(cores: Cores) -> None:
    """Pin the calling process (and what it starts from now on) to the rest's cores: the job's
    launcher, in its preexec_fn, and the benchmark itself."""
    os.sched_setaffinity(0, cores.rest)


def thread_ids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []


class RankPinner:
    """Moves every rank of the job under `root` to a core of its own, and records what it saw:
    `ranks` (pid -> the cores its threads may run on) and `rest` (the cores of every other
    process of the job, together; the warm interpreter's imports, before any rank, aside)."""

    def __init__(self, root: int, cores: Cores, is_rank: Callable[[list[str]], bool]):
        self.root, self.cores, self.is_rank = root, cores, is_rank
        self.core_of: dict[int, int] = {}  # rank pid -> its core
        self.ranks: dict[int, set[int]] = {}
        self.rest: set[int] = set()
        self.ranks_own: set[int] = set()  # pids seen below a rank (theirs, even once reparented)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rank-pinner", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(PIN_EVERY_S):
            try:
                tree = [psutil.Process(self.root), *psutil.Process(self.root).children(True)]
            except psutil.NoSuchProcess:
                return
            for p in tree:
                try:
                    self._look_at(p)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue

    def _look_at(self, p: psutil.Process) -> None:
        # A rank stays one by pid (an exiting process's command line reads empty); a process a
        # rank started is the rank's and runs on its core.
        if p.pid in self.core_of or (p.pid != self.root and self.is_rank(p.cmdline())):
            core = self.core_of.get(p.pid)
            if core is None:  # the next core no live rank holds
                held = {c for pid, c in self.core_of.items() if psutil.pid_exists(pid)}
                free = [c for c in self.cores.ranks if c not in held] or list(self.cores.ranks)
                core = self.core_of[p.pid] = free[0]
            seen: set[int] = set()
            for tid in thread_ids(p.pid):
                try:
                    if os.sched_getaffinity(tid) != {core}:
                        os.sched_setaffinity(tid, {core})
                    seen |= os.sched_getaffinity(tid)
                except (ProcessLookupError, PermissionError):
                    continue  # the thread ended
            if seen:
                self.ranks[p.pid] = seen
        elif p.pid in self.ranks_own or any(a.pid in self.core_of for a in p.parents()):
            self.ranks_own.add(p.pid)  # a rank's child or deeper (a compiler a build runs)
        elif not _importing(p.cmdline()):
            self.rest |= set(p.cpu_affinity() or [])


def _importing(cmdline: list[str]) -> bool:
    """Whether this is a node's warm interpreter: it imports on any core, but only before its
    node's first workers (it forks them once its imports are done, back on the agent's cores)."""
    return bool(cmdline) and cmdline[0].startswith(WARM_TITLE)
