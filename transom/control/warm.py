"""Warm worker interpreters: Python processes that have already imported torch, waiting for a job.

Starting a worker costs seconds before the script runs its first line of its own (the
interpreter, then `import torch`), and a restart pays it again, on the critical path. The agent
therefore keeps one warm interpreter per local rank ready: a child started with the agent's
environment that imports the heavy modules and then blocks reading one line on stdin. When a
generation starts, the agent sends it the worker's environment, argv and log file; the child
takes on that environment, sends its output to the log and runs the script through the worker
bootstrap (transom.control.bootstrap: the stack dump handler and the zero-code instrumentation,
then the script as `__main__`, exactly as `python -u SCRIPT ARGS` would). Each warm interpreter
serves one worker and is then gone; the agent starts replacements once the new workers are under
way, so their imports do not compete with the restart they are meant to speed up.

The imports of a replacement run under the SCHED_IDLE scheduling policy where this process may
return to the normal policy afterwards (root, or RLIMIT_NICE of at least 20): they then use only
CPU time the workers leave idle, instead of slowing training down while they import (about 3 s
of CPU each; on a node whose cores are all busy that is training time). The interpreter returns
to the normal policy as soon as its job arrives; an interpreter handed a job before its imports
are done is returned to it by the pool at once.

In `ps` and `top` a waiting interpreter is titled `transom warm interpreter (job J, node N)`;
once it becomes a worker its title is the worker's command line, `python -u SCRIPT ARGS`, as a
cold-started worker's is (setproctitle), so operators find ranks by script and arguments.

What it must never do: run anything before the job arrives except imports, or outlive the
agent (they are started like workers, dying with their parent). Environment variables that a
library reads at import time (e.g. OMP_NUM_THREADS) come from the agent's environment.
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from transom.common import env as env_names
from transom.utils.procs import new_session_dying_with_parent, stop_tree

# Modules every warm interpreter imports before it waits (torch._inductor.config: what
# torch.compile and torch.use_deterministic_algorithms import, 1.7 s here); env.WARM_IMPORTS
# overrides.
DEFAULT_IMPORTS = "torch,torch.distributed,torch.nn.parallel,torch.optim,torch._inductor.config"
# Warm replacements once the new workers report progress, or at the latest this long after
# they started (for scripts that never report).
REFILL_DELAY_S = 30.0
READY = b"R"
NICE_CEILING = 20  # RLIMIT_NICE needed to leave SCHED_IDLE without privileges (nice 0)


def can_leave_idle_policy() -> bool:
    """Whether a process here may switch from SCHED_IDLE back to the normal policy."""
    return hasattr(os, "SCHED_IDLE") and (
        os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= NICE_CEILING
    )


def set_normal_policy(pid: int = 0) -> None:
    try:
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass  # gone, or not allowed: it keeps its policy


class WarmPool:
    """Up to `size` warm interpreters for one agent; call every method from the agent's main thread
    (PR_SET_PDEATHSIG follows the thread that forks)."""

    def __init__(
        self, size: int, env: dict[str, str], log_path: Path, node_id: str | None = None
    ) -> None:
        self.size = size
        self.env = env
        self.log_path = Path(log_path)
        # What `ps` shows while it waits (the job and node, where known).
        node = node_id or env.get(env_names.NODE_ID)
        where = [f"job {env[env_names.JOB_ID]}"] if env.get(env_names.JOB_ID) else []
        where += [f"node {node}"] if node else []
        self.title = "transom warm interpreter" + (f" ({', '.join(where)})" if where else "")
        self.ready: list[subprocess.Popen[bytes]] = []
        self._imported: set[int] = set()  # pids whose imports are done
        # How the newest `launch` found its interpreter: "warm" (imports done) or "importing".
        self.last_launch = ""
        self._used_at = 0.0
        if can_leave_idle_policy():
            self.env = {**env, env_names.WARM_IDLE_IMPORTS: "1"}

    def fill(self, workers_progressing: bool = False) -> None:
        """Start interpreters until `size` are waiting, unless workers have just been started
        from the pool and are not yet under way."""
        if not workers_progressing and time.monotonic() - self._used_at < REFILL_DELAY_S:
            return
        self.ready = [p for p in self.ready if p.poll() is None]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        while len(self.ready) < self.size:
            with open(self.log_path, "ab") as log:
                self.ready.append(
                    subprocess.Popen(
                        [sys.executable, "-u", "-m", "transom.control.warm", self.title],
                        env=self.env,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        preexec_fn=new_session_dying_with_parent,
                    )
                )

    def warm_count(self) -> int:
        """How many interpreters have finished their imports and wait for a worker."""
        for p in self.ready:
            out = _pipe(p.stdout)
            if p.pid not in self._imported and select.select([out], [], [], 0)[0]:
                if out.read(1) == READY:
                    self._imported.add(p.pid)
        return sum(1 for p in self.ready if p.pid in self._imported and p.poll() is None)

    def launch(
        self, argv: list[str], env: dict[str, str], log_path: Path
    ) -> subprocess.Popen[bytes] | None:
        """Hand a worker to a waiting interpreter; None when none is alive (start it cold)."""
        self._used_at = time.monotonic()
        while self.ready:
            proc = self.ready.pop(0)
            self.last_launch = "warm" if proc.pid in self._imported else "importing"
            if proc.pid not in self._imported:
                set_normal_policy(
                    proc.pid
                )  # still importing, perhaps at idle priority: now it is urgent
            self._imported.discard(proc.pid)
            _pipe(proc.stdout).close()
            if proc.poll() is not None:
                continue
            job = {"argv": argv, "env": env, "log": str(log_path), "cwd": os.getcwd()}
            try:
                stdin = _pipe(proc.stdin)
                stdin.write(json.dumps(job).encode() + b"\n")
                stdin.close()
            except OSError:
                continue  # it died between poll and write
            return proc
        return None

    def close(self) -> None:
        stop_tree([p.pid for p in self.ready if p.poll() is None], grace_s=1.0)
        for p in self.ready:
            p.wait()
            _pipe(p.stdout).close()
        self.ready = []
        self._imported.clear()


def _pipe(stream: IO[bytes] | None) -> IO[bytes]:
    """A pipe the pool opened (stdin=PIPE, stdout=PIPE), so never None."""
    assert stream is not None
    return stream


def _serve() -> int:
    """The warm interpreter itself: import, wait for one job, become that worker."""
    import importlib

    import setproctitle

    from transom.control import bootstrap

    if len(sys.argv) > 1:
        setproctitle.setproctitle(sys.argv[1])
    idle = os.environ.pop(env_names.WARM_IDLE_IMPORTS, "") == "1"
    if idle:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            idle = False
    for name in os.environ.get(env_names.WARM_IMPORTS, DEFAULT_IMPORTS).split(","):
        if name.strip():
            importlib.import_module(name.strip())
    try:  # tell the pool we are ready (it stops listening once it has handed us a job)
        os.write(1, READY)
    except OSError:
        pass
    line = sys.stdin.buffer.readline()
    if not line:
        return 0  # the pool was closed before a job came
    if idle:
        set_normal_policy()
    job = json.loads(line)
    log_fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    bootstrap.run_script(job["argv"])  # the same start-up as a cold worker's
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
