"""Warm workers: one interpreter per node holds the imports, and forks each worker from them.

Starting a worker costs seconds before the script runs its first line of its own (the
interpreter, then `import torch`), and a restart pays it again, on the critical path. The agent
therefore keeps a warm interpreter: a child started with the agent's environment that imports
the heavy modules once and then waits for jobs on stdin. For each worker of a generation the
agent sends it the worker's environment, argv and log file; it forks, and the child takes on that
environment, sends its output to the log and runs the script through the worker bootstrap
(transom.control.bootstrap: the stack dump handler and the zero-code instrumentation, then the
script as `__main__`, exactly as `python -u SCRIPT ARGS` would). A fork takes about 10 ms and
the interpreter stays, so every generation, the first and every restart on this node, starts
its workers from imports already done, and nothing is imported again beside the new workers'
first steps (a pool of single-use interpreters refilled after each generation imported torch
again each time, about 3 s of CPU per worker, beside the training it was meant to speed up).

The workers are the interpreter's children, not the agent's: it reaps them and tells the agent
each pid it forked ("P pid") and each exit ("X pid code", the code as `subprocess` gives it:
negative for a signal). `ForkedWorker` is the agent's handle on one, with the `Popen` methods the
agent uses. A worker lives in a session of its own and dies with the interpreter
(PR_SET_PDEATHSIG), which dies with the agent: no worker outlives its agent.

The imports run at idle priority (transom.utils.idle_priority: SCHED_IDLE, and its session's
autogroup niced) where this process may return to the normal policy afterwards (root, or
RLIMIT_NICE of at least 20): they then use only CPU time the
workers leave idle, on any core (the agent's may be confined to a few, the ranks' cores are idle
before the first workers start). Once they are done, and as soon as a job arrives before then,
the interpreter returns to the normal policy and to the agent's cores, and its workers with it.

Where a launcher runs several nodes on one machine, the interpreter is forked from the machine's
warm template instead (transom.control.warm_template: one import of torch, not one a node); it
is then the template's child, not the agent's, and ends when the agent closes its stdin (or
dies), as it does here; the pool falls back to starting its own when the template cannot serve.

In `ps` and `top` the interpreter is titled `transom warm interpreter (job J, node N)`; each
worker's title is its command line, `python -u SCRIPT ARGS`, as a cold-started worker's is.

What it must never do: run anything but imports and forks (it never touches a tensor, so no
library thread or state of a computation is forked into a worker), or outlive the agent.
Environment variables that a library reads at import time (e.g. OMP_NUM_THREADS) come from the
agent's environment. A child gets a fresh random seed for `random` and numpy, as a new
interpreter would.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import IO

from transom.common import env as env_names
from transom.control.warm_template import TemplateInterpreter
from transom.control.warm_template import request as template_request
from transom.utils import idle_priority
from transom.utils.procs import (
    die_with_parent,
    new_session_dying_with_parent,
    running,
    wait_polled,
)

log = logging.getLogger("transom.warm")

# Modules the interpreter imports before it waits: torch._inductor.config is what torch.compile
# and use_deterministic_algorithms import (1.7 s here), the checkpoint engine what a worker that
# saves through Transom imports (27 ms a worker, at every restart). env.WARM_IMPORTS overrides.
TORCH_IMPORTS = "torch,torch.distributed,torch.nn.parallel,torch.optim,torch._inductor.config"
DEFAULT_IMPORTS = TORCH_IMPORTS + ",transom.checkpoint.engine"
READY = b"R"
TITLE = "transom warm interpreter"  # what `ps` shows of it, before "(job J, node N)"
# How long a launch waits for imports still under way: less than a cold start takes to import.
IMPORTS_WAIT_S = 60.0
FORK_REPLY_S = 10.0  # how long a launch waits for the pid of the worker it asked for
# A retired interpreter's worker that no longer runs, its exit unreported this long: killed.
RETIRED_SILENCE_S = 2.0
MAX_MESSAGE = 64  # bytes of one line from the interpreter
CANCELLED = 75  # the exit of a worker forked after its launch was given up


class ForkedWorker:
    """The agent's handle on a worker the warm interpreter forked: `pid`, `returncode`, `poll`,
    `wait` and `kill`, as `subprocess.Popen` has them."""

    def __init__(self, pid: int, pool: WarmPool, interpreter: _Interpreter) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pool = pool
        self._interpreter = interpreter

    def poll(self) -> int | None:
        if self.returncode is None:
            self._pool.read_messages(0.0)
            self._settle()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return wait_polled(self.poll, self._pool.read_messages, timeout, self.pid)

    def kill(self) -> None:
        if self.returncode is None:
            _kill(self.pid)

    def _settle(self) -> None:
        """Take the exit the interpreter reported; with the interpreter gone (its workers die
        with it, SIGKILL), or retired and silent for RETIRED_SILENCE_S about a worker that no
        longer runs, the worker counts as killed."""
        code = self._pool.exits.pop(self.pid, None)
        if code is not None:
            self.returncode = code
        elif not running(self.pid) and (
            self._interpreter.proc.poll() is not None or self._interpreter.silent_on(self.pid)
        ):
            self.returncode = -signal.SIGKILL
        if self.returncode is not None:
            self._interpreter.live.discard(self.pid)  # its interpreter no longer serves it


class _Interpreter:
    """One warm interpreter as the pool sees it: its process, what it said, and the workers it
    forked that have not been seen to exit (`live`)."""

    def __init__(self, proc: subprocess.Popen[bytes] | TemplateInterpreter) -> None:
        self.proc = proc
        self.imported = False  # its imports are done
        self.forked: list[int] = []  # pids reported, not yet taken by `launch`
        self.live: set[int] = set()  # pids handed out by `launch`, their exit not yet taken
        self.unwanted: set[int] = set()  # retired: pids forked for the launch given up
        self.retired = False  # it failed a launch: it serves only the workers it has
        self.cancelled: Path | None = None  # retired: the marker that cancels the given-up job
        self.buffer = b""
        self._dead_since: dict[int, float] = {}  # retired: a worker seen gone, its exit unsaid

    def silent_on(self, pid: int) -> bool:
        """Retired, and `pid` (no longer running) has gone unreported for RETIRED_SILENCE_S."""
        if not self.retired:
            return False
        first = self._dead_since.setdefault(pid, time.monotonic())
        return time.monotonic() - first >= RETIRED_SILENCE_S

    def end(self) -> None:
        """Kill it (workers still running die with it) and close its pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.cancelled is not None:
            self.cancelled.unlink(missing_ok=True)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class WarmPool:
    """The node's warm interpreter, started, used and replaced by the agent; call every method
    from the agent's main thread (PR_SET_PDEATHSIG follows the thread that forks). `size`: the
    workers a generation starts on this node (what `warm_count` reports once imports are done).

    An interpreter that fails a launch is replaced; while workers it forked before still run it
    is retired, not killed (they would die with it, costing their generation a restart): it is
    ended once the last of them has exited, and a worker it forks late, for the launch given
    up, is killed at once (that launch started its worker cold)."""

    def __init__(
        self,
        size: int,
        env: dict[str, str],
        log_path: Path,
        node_id: str | None = None,
    ) -> None:
        self.size = size
        # The machine's warm template (its socket), when the launcher runs one: interpreters
        # are forked from its imports (transom.control.warm_template); None: each imports.
        self.template = env.get(env_names.WARM_TEMPLATE)
        env = {k: v for k, v in env.items() if k != env_names.WARM_TEMPLATE}
        self.env = env
        self.log_path = Path(log_path)
        # What `ps` shows while it waits (the job and node, where known).
        node = node_id or env.get(env_names.NODE_ID)
        where = [f"job {env[env_names.JOB_ID]}"] if env.get(env_names.JOB_ID) else []
        where += [f"node {node}"] if node else []
        self.title = TITLE + (f" ({', '.join(where)})" if where else "")
        self.current: _Interpreter | None = None
        self.retired: list[_Interpreter] = []
        self.exits: dict[int, int] = {}  # pid -> exit code, reported and not yet taken
        # How the newest `launch` found the interpreter: "warm" (imports done) or "importing".
        self.last_launch = ""
        if idle_priority.can_leave():
            self.env = {**env, env_names.WARM_IDLE_IMPORTS: "1"}

    @property
    def interpreter(self) -> subprocess.Popen[bytes] | TemplateInterpreter | None:
        """The process of the interpreter that serves launches, if any."""
        return self.current.proc if self.current is not None else None

    @property
    def imported(self) -> bool:
        return self.current is not None and self.current.imported

    def fill(self) -> None:
        """Start the interpreter if there is none (the first time, or after it died)."""
        if self.current is not None and self.current.proc.poll() is None:
            return
        self.read_messages(0.0)  # the exits a dead interpreter reported last
        if self.current is not None:
            if isinstance(self.current.proc, TemplateInterpreter) and self.current.proc.refused:
                self.template = None  # it refused this node: import as without it
            self.current.end()
        if self.template is not None:
            forked = template_request(self.template, self.title, self.env, self.log_path)
            if forked is not None:
                self.current = _Interpreter(forked)
                return
            self.template = None  # not reached: gone with its launcher, or never there
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.current = _Interpreter(
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
        """How many workers can start from finished imports now: `size`, or 0."""
        self._unless_refused()
        self.read_messages(0.0)
        alive = self.current is not None and self.current.proc.poll() is None
        return self.size if alive and self.imported else 0

    def launch(self, argv: list[str], env: dict[str, str], log_path: Path) -> ForkedWorker | None:
        """Fork a worker from the interpreter, waiting for imports still under way; None when
        there is no interpreter, or it failed (start that worker cold)."""
        self._unless_refused()
        current = self.current
        if current is None or current.proc.poll() is not None:
            return None
        self.read_messages(0.0)
        self.last_launch = "warm" if current.imported else "importing"
        if not current.imported:
            if isinstance(current.proc, subprocess.Popen):  # a template's imports are not idle
                idle_priority.leave(current.proc.pid)  # perhaps at idle priority: now urgent
            deadline = time.monotonic() + IMPORTS_WAIT_S
            while not current.imported and current.proc.poll() is None:
                if time.monotonic() > deadline:
                    return self._given_up("its imports took too long")
                self.read_messages(0.1)
        # A worker forked for a launch given up finds this file and exits before the script.
        cancel = Path(log_path).parent / f".warm-cancelled-{uuid.uuid4().hex[:12]}"
        job = {"argv": argv, "env": env, "log": str(log_path), "cwd": os.getcwd()}
        job["cancel"] = str(cancel)
        try:
            os.write(_pipe(current.proc.stdin).fileno(), json.dumps(job).encode() + b"\n")
        except OSError:
            return self._given_up("it is gone")
        deadline = time.monotonic() + FORK_REPLY_S
        while not current.forked:
            if current.proc.poll() is not None or time.monotonic() > deadline:
                return self._given_up("it did not fork the worker", cancel)
            self.read_messages(0.1)
        pid = current.forked.pop(0)
        current.live.add(pid)
        return ForkedWorker(pid, self, current)

    def _unless_refused(self) -> None:
        """The template refused this node's interpreter: start one of its own now."""
        proc = self.current.proc if self.current is not None else None
        if isinstance(proc, TemplateInterpreter) and proc.poll() is not None and proc.refused:
            self.fill()

    def read_messages(self, timeout: float) -> None:
        """Take what the interpreters said (ready, a pid forked, a pid's exit), waiting up to
        `timeout` for the first word; end a retired one whose workers have all exited."""
        interpreters = [i for i in (self.current, *self.retired) if i is not None]
        streams = {i.proc.stdout.fileno(): i for i in interpreters if i.proc.stdout is not None}
        try:
            readable = select.select(list(streams), [], [], timeout)[0] if streams else []
        except (OSError, ValueError):
            return
        for fd in readable:
            try:
                data = os.read(fd, 65536)
            except OSError:
                continue
            self._take(streams[fd], data)
        # A retired one is ended once its workers have exited, or when it died (they with it).
        for done in [i for i in self.retired if not i.live or i.proc.poll() is not None]:
            self.retired.remove(done)
            done.end()

    def _take(self, interpreter: _Interpreter, data: bytes) -> None:
        buffer = interpreter.buffer + data
        if not interpreter.imported and buffer.startswith(READY):
            interpreter.imported = True
            buffer = buffer[len(READY) :]
        *lines, buffer = buffer.split(b"\n")
        interpreter.buffer = buffer[-MAX_MESSAGE:]
        for line in lines:
            parts = line.split()
            try:
                if len(parts) == 2 and parts[0] == b"P":
                    pid = int(parts[1])
                    if interpreter.retired:  # a launch given up, forked late: started cold
                        log.warning("killing worker %d, forked after its launch was given up", pid)
                        interpreter.unwanted.add(pid)
                        _kill(pid)
                    else:
                        interpreter.forked.append(pid)
                elif len(parts) == 3 and parts[0] == b"X":
                    pid = int(parts[1])
                    if pid not in interpreter.unwanted:
                        self.exits[pid] = int(parts[2])
            except ValueError:
                continue  # not a message of ours: nothing to take from it

    def close(self) -> None:
        """End every interpreter (workers, if any are left, die with them)."""
        for interpreter in [i for i in (self.current, *self.retired) if i is not None]:
            interpreter.end()
        self.current = None
        self.retired = []

    def _given_up(self, why: str, cancel: Path | None = None) -> ForkedWorker | None:
        """None, and the interpreter that failed a launch ended, or retired while workers it
        forked run (the next `fill` starts another); `cancel`: the marker that makes the job it
        was sent exit at once, if forked late."""
        log.warning("warm interpreter not used (%s): starting the worker cold", why)
        current, self.current = self.current, None
        if current is not None:
            self.read_messages(0.0)
            if current.live and current.proc.poll() is None:
                current.retired = True
                if cancel is not None:
                    cancel.touch()
                    current.cancelled = cancel
                for pid in current.forked:  # forked meanwhile, never handed out
                    _kill(pid)
                current.forked.clear()
                self.retired.append(current)
            else:
                current.end()
        return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _pipe(stream: IO[bytes] | None) -> IO[bytes]:
    """A pipe the pool opened (stdin=PIPE, stdout=PIPE), so never None."""
    assert stream is not None
    return stream


# -- the interpreter itself -----------------------------------------------------------------------


def _serve() -> int:
    """Import, then fork one worker per job line until stdin closes; report forks and exits."""
    import setproctitle

    if len(sys.argv) > 1:
        setproctitle.setproctitle(sys.argv[1])
    idle = os.environ.pop(env_names.WARM_IDLE_IMPORTS, "") == "1"
    cores = os.sched_getaffinity(0)
    if idle and idle_priority.enter():
        # At idle priority the imports may use any core's idle time, the ranks' cores too
        # (idle before the first workers start); the workers get the agent's cores back.
        _set_affinity(set(range(os.cpu_count() or 1)))  # refused: the agent's cores only
    import_modules()
    if idle:  # the agent's cores first: at the normal policy it may use only those
        _set_affinity(cores)
        idle_priority.leave()  # waiting costs nothing; a fork must not wait for idle CPU
    return serve_forks()


def import_modules() -> None:
    """The imports every worker shares (env.WARM_IMPORTS, else DEFAULT_IMPORTS)."""
    import importlib

    for name in os.environ.get(env_names.WARM_IMPORTS, DEFAULT_IMPORTS).split(","):
        if name.strip():
            importlib.import_module(name.strip())


def serve_forks() -> int:
    """With the imports done: say READY, then fork one worker per job line on stdin until it
    closes, reporting each fork and exit on stdout (returns in each worker, with its code)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    _say(READY)
    pending = b""
    while True:
        readable = select.select([0, wake_r], [], [])[0]
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap()
        if 0 not in readable:
            continue
        data = os.read(0, 65536)
        if not data:  # the agent closed the pool, or died: workers still running die with us,
            os._exit(0)  # at once (an interpreter's teardown with torch loaded takes a second)
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            interpreter = os.getpid()
            pid = os.fork()
            if pid == 0:
                os.close(wake_r)
                os.close(wake_w)
                return _become_worker(json.loads(line), interpreter)
            _say(b"P %d\n" % pid)


def _set_affinity(cores: set[int]) -> None:
    try:
        os.sched_setaffinity(0, cores)
    except OSError:
        pass  # a core taken away meanwhile: the kernel's choice stands


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(b"X %d %d\n" % (pid, os.waitstatus_to_exitcode(status)))


def _say(message: bytes) -> None:
    try:
        os.write(1, message)
    except OSError:
        pass  # the agent is gone: we die with it


def _become_worker(job: dict[str, object], interpreter: int) -> int:
    """In the forked child: take on the job's environment and output, then run the script.
    `interpreter`: the pid that forked it, taken before the fork (a child first scheduled after
    the interpreter died would see its new parent in getppid)."""
    from transom.control import bootstrap

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    die_with_parent()
    if os.getppid() != interpreter:
        os._exit(1)  # the interpreter died before we could follow it
    cancel = job.get("cancel")
    if isinstance(cancel, str) and os.path.exists(cancel):
        os._exit(CANCELLED)  # forked after the agent gave this launch up: it started cold
    log_fd = os.open(str(job["log"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    env = job["env"]
    argv = job["argv"]
    assert isinstance(env, dict) and isinstance(argv, list)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    os.chdir(str(job["cwd"]))
    _reseed()
    bootstrap.run_script([str(a) for a in argv])  # the same start-up as a cold worker's
    return 0


def _reseed() -> None:
    """Fresh seeds for numpy's global generator (`random` reseeds itself after a fork), so no two
    workers draw the same numbers unless their script seeds them."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            numpy.random.seed()
        except Exception:  # noqa: BLE001 - a library's own state: never fail a worker for it
            pass


if __name__ == "__main__":
    sys.exit(_serve())
