"""One node's workers for one generation: start them torchrun-style, watch them, stop them.

Each worker is `python SCRIPT ARGS`, started through the worker bootstrap (forked from the
node's warm interpreter, transom.control.warm, else `python -u -m transom.control.bootstrap
SCRIPT ARGS`; titled `python -u SCRIPT ARGS` either way: transom.control.bootstrap), in its own
process group with the environment
torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) plus TRANSOM_* variables, its
stdout and stderr in one log file per rank and generation. Workers die with their agent
(PR_SET_PDEATHSIG), and `stop()` ends each worker's whole process tree. `pause()` freezes the
trees (SIGSTOP) while the agent cannot tell whether the job went on without this node; a paused
group is resumed, or killed without running again (`stop()`).

Nothing of a generation listens beyond the node's address: the generation's torch store is
served on the master node's address by a process of the agent's (transom.control.store_host),
and gloo listens on the interface that carries the node's address (GLOO_SOCKET_IFNAME: `lo` in
a single-machine job).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transom.common.records import FailureReport
from transom.control.failures import classify_exit
from transom.control.warm import ForkedWorker, WarmPool
from transom.utils.exit_watch import ExitWatch
from transom.utils.net import interface_of
from transom.utils.procs import new_session_dying_with_parent, signal_trees, stop_tree

log = logging.getLogger("transom.workers")

STOP_GRACE_S = 5.0
# How long `poll` waits for the exit code of a worker its ExitWatch saw exit (a forked worker's
# comes from the warm interpreter, which reaps it a moment later).
EXIT_REPORT_S = 0.05
# gloo listens on the address of this interface (torch reads it; without it, on the address the
# machine's host name resolves to, which may be any interface).
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


@dataclass
class Assignment:
    """Where this node's workers sit in the generation's world."""

    job_id: str
    node_id: str
    generation: int
    restart_count: int
    max_restarts: int
    group_rank: int
    group_world_size: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    host: str  # the address this node's ports listen on (transom.utils.net.bind_address)

    @property
    def world_size(self) -> int:
        return self.group_world_size * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        return self.group_rank * self.nproc_per_node + local_rank


def worker_env(a: Assignment, local_rank: int, extra: dict[str, str]) -> dict[str, str]:
    """The environment torchrun would give this worker, plus Transom's own variables."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(
        {
            "RANK": str(a.global_rank(local_rank)),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(a.world_size),
            "LOCAL_WORLD_SIZE": str(a.nproc_per_node),
            "GROUP_RANK": str(a.group_rank),
            "GROUP_WORLD_SIZE": str(a.group_world_size),
            "ROLE_RANK": str(a.global_rank(local_rank)),
            "ROLE_WORLD_SIZE": str(a.world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": a.master_addr,
            "MASTER_PORT": str(a.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(a.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts),
            "TORCHELASTIC_RUN_ID": a.job_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank is a client (store_host)
            "TRANSOM_JOB_ID": a.job_id,
            "TRANSOM_NODE_ID": a.node_id,
            "TRANSOM_GENERATION": str(a.generation),
        }
    )
    env.update(extra)
    if GLOO_IFNAME not in os.environ:  # an operator's own choice of interface wins
        interface = interface_of(a.host)
        if interface is not None:  # else gloo picks the address the host name resolves to
            env[GLOO_IFNAME] = interface
    return env


class WorkerGroup:
    """The `nproc_per_node` worker processes of one node in one generation."""

    def __init__(
        self,
        assignment: Assignment,
        script: str,
        script_args: list[str],
        log_dir: Path,
        extra_env: dict[str, str],
    ):
        self.assignment = assignment
        self.script = script
        self.script_args = list(script_args)
        self.log_dir = Path(log_dir)
        self.extra_env = extra_env
        self.processes: list[subprocess.Popen[bytes] | ForkedWorker] = []
        self.log_paths: list[Path] = []
        self.paused_at: float | None = None  # monotonic time of pause(); None while running
        self._lock = threading.Lock()  # pause (the agent's guard thread) against start and stop
        # Per local rank, how its worker started: in a "warm" interpreter, one still "importing",
        # or "cold" (for the agent's log: a restart's start-up depends on it).
        self.started_as: list[str] = []
        self._exits: ExitWatch | None = None

    def start(
        self, pool: WarmPool | None = None, on_exit: Callable[[int], None] | None = None
    ) -> None:
        """Spawn the workers, in warm interpreters from `pool` where it has them; `on_exit` is
        called (from another thread) with the pid of each that exits, as it exits
        (utils.exit_watch), so that the agent's loop need not wait for its next tick to `poll`.

        Call from the agent's main thread (PDEATHSIG follows the forking thread)."""
        with self._lock:
            self._start(pool)
            if on_exit is not None:
                self._exits = ExitWatch([p.pid for p in self.processes], on_exit)

    def _start(self, pool: WarmPool | None) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        a = self.assignment
        argv = [self.script, *self.script_args]
        for local_rank in range(a.nproc_per_node):
            path = self.log_dir / f"rank{a.global_rank(local_rank)}.log"
            env = worker_env(a, local_rank, self.extra_env)
            proc: subprocess.Popen[bytes] | ForkedWorker | None = None
            if pool is not None:
                proc = pool.launch(argv, env, path)
            self.started_as.append(pool.last_launch if pool is not None and proc else "cold")
            if proc is None:
                with open(path, "ab") as log:
                    proc = subprocess.Popen(
                        [sys.executable, "-u", "-m", "transom.control.bootstrap", *argv],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        preexec_fn=new_session_dying_with_parent,
                    )
            self.processes.append(proc)
            self.log_paths.append(path)

    @property
    def pids(self) -> dict[str, int]:
        """Global rank (as a string, JSON-ready) -> worker pid."""
        return {str(self.assignment.global_rank(i)): p.pid for i, p in enumerate(self.processes)}

    def poll(self) -> tuple[str, list[FailureReport]]:
        """('running' | 'succeeded' | 'failed', failures so far)."""
        codes = [p.poll() for p in self.processes]
        exited = self._exits.exited if self._exits is not None else set()
        for i, p in enumerate(self.processes):
            if codes[i] is None and p.pid in exited:  # its exit is on its way (a warm worker's
                codes[i] = _wait(p, EXIT_REPORT_S)  # from its interpreter): take it now
        failures = [
            classify_exit(self.assignment.global_rank(i), i, code, self.log_paths[i])
            for i, code in enumerate(codes)
            if code not in (None, 0)
        ]
        if failures:
            return "failed", failures
        if all(code == 0 for code in codes):
            return "succeeded", []
        return "running", []

    def pause(self, now: float) -> bool:
        """Freeze every worker's process tree (SIGSTOP): no instruction of it runs until resume.
        False (and nothing done) when already paused or not started."""
        with self._lock:
            if self.paused_at is not None or not self.processes:
                return False
            signal_trees([p.pid for p in self.processes if p.poll() is None], signal.SIGSTOP)
            self.paused_at = now
            return True

    def resume(self) -> None:
        with self._lock:
            signal_trees([p.pid for p in self.processes if p.poll() is None], signal.SIGCONT)
            self.paused_at = None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """End every worker's process tree (SIGTERM, then SIGKILL) and reap them; a paused group
        is SIGKILLed at once, so it never runs again."""
        if self._exits is not None:
            self._exits.close()
        with self._lock:
            alive = [p.pid for p in self.processes if p.poll() is None]
            if self.paused_at is not None:
                signal_trees(alive, signal.SIGKILL)
            else:
                stop_tree(alive, grace_s)
        for p in self.processes:
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait(p: subprocess.Popen[bytes] | ForkedWorker, timeout: float) -> int | None:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
