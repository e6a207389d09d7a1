"""The machine's warm template: one interpreter holds the imports for every node a launcher runs.

Each node's warm interpreter (transom.control.warm) imports torch before it can fork workers,
about 3 s of CPU. On a real cluster every node does that on CPUs of its own; but a launcher that
runs several nodes on one machine (`transom run --nnodes 4` without `--store`, `transom demo`,
`--local-nodes N`) had all of them import at once on the same cores: the demo's 5 interpreters
took 5 of its 8 s of start-up on 2 cores, and each node started later to replace an evicted one
imported again beside the training. Such a launcher starts this template first, in a session of
its own: with the kernel's autogroups it then has a core to itself while the agents, servers and
controllers start (in the launcher's session it had a share of one, and its 2 s of import were
the start-up's critical path, the other core idle at its end). It imports once, then forks each
node's warm interpreter on request (about 10 ms), which from then on is exactly what `python -m
transom.control.warm` is after its imports: its own session, the agent's environment, working
directory and cores, its stdin, stdout and log the agent's pipes and file.

The request (`request`, from the agent's WarmPool): one datagram on a Unix SEQPACKET socket in a
private directory, the interpreter's settings as JSON with its three descriptors (SCM_RIGHTS);
the reply: `P <pid>`, or `E <why>`. The template accepts only its own user's requests (the
peer's credentials), checks every field's type and size, and refuses an environment that
differs from its own in anything but TRANSOM_ variables (a library may read one at import, as
torch does OMP_NUM_THREADS): that agent starts an interpreter of its own, as without a template.
The interpreter is not the agent's child: it ends when the agent closes its stdin, which the
kernel does when the agent dies, and its workers die with it (PR_SET_PDEATHSIG), so no worker
outlives its agent; `TemplateInterpreter` is the agent's handle on it (a pidfd tells its exit).

What it must never do: run a thread or touch a tensor before it forks (an interpreter must start
as clean as one that imported by itself), hand one agent's descriptors to another (each request
is served and its descriptors closed before the next is read), or outlive its launcher.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transom.common import env as env_names
from transom.utils.procs import new_session_dying_with_parent, running, wait_polled

log = logging.getLogger("transom.warm")

TITLE = "transom warm template"
MAX_REQUEST = 256 * 1024  # one request: an environment of a few KiB, with room
MAX_REPLY = 256
ENV_PREFIX = "TRANSOM_"  # variables that may differ between the template and an agent
STARTED_S = 10.0  # how long a launcher waits for its template to listen
CONNECT_S = 2.0  # how long an agent waits to hand in its request (the template may be importing)
REQUEST_S = 1.0  # how long the template waits for a request once a peer connected
_PID_REPLY = re.compile(rb"P (\d{1,10})")


def interpreter_env(base: Mapping[str, str], job_id: str) -> dict[str, str]:
    """The environment a warm interpreter imports with, from its agent's (or, for the template,
    its launcher's) `base`: one definition, so that the two compare equal (`comparable`). The
    job id makes warm interpreters findable as the job's own processes."""
    return {"OMP_NUM_THREADS": "1", **base, env_names.JOB_ID: job_id}


def comparable(env: dict[str, str]) -> dict[str, str]:
    """What of an environment must be the template's own for its imports to serve it."""
    return {k: v for k, v in env.items() if not k.startswith(ENV_PREFIX)}


# -- the agent's side ---------------------------------------------------------------------------


class TemplateInterpreter:
    """The agent's handle on a warm interpreter the template forks: `pid` (None until the
    template said it), `stdin`, `stdout`, `poll`, `kill` and `wait`, as `subprocess.Popen` has
    them. An exit's code is not known (the interpreter is not the agent's child): -SIGKILL.
    `refused`: the template said no (or never answered); the agent then starts its own."""

    def __init__(self, conn: socket.socket, stdin: int, stdout: int) -> None:
        self.conn: socket.socket | None = conn
        self.stdin = open(stdin, "wb", buffering=0)  # noqa: SIM115 - closed by the pool
        self.stdout = open(stdout, "rb", buffering=0)  # noqa: SIM115 - closed by the pool
        self.pid: int | None = None
        self.returncode: int | None = None
        self.refused = False
        self._pidfd: int | None = None

    def poll(self) -> int | None:
        self._take_reply()
        if self.returncode is None and self.pid is not None and self._gone():
            self._ended(-signal.SIGKILL)
        return self.returncode

    def kill(self) -> None:
        self._take_reply()
        if self.returncode is not None:
            return
        if self.pid is None:  # not forked yet: it reads the stdin the pool closes, and ends
            self._close_conn()
            self._ended(-signal.SIGKILL)
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> int:
        return wait_polled(self.poll, self._news, timeout, self.pid or 0)

    def _news(self, seconds: float) -> None:
        """Wait up to `seconds` for its exit or the template's reply."""
        watched = [fd for fd in (self._pidfd, self._conn_fd()) if fd is not None]
        select.select(watched, [], [], seconds)

    def _conn_fd(self) -> int | None:
        return self.conn.fileno() if self.conn is not None else None

    def _take_reply(self) -> None:
        if self.conn is None:
            return
        try:
            data = self.conn.recv(MAX_REPLY)
        except BlockingIOError:
            return  # not yet: the template is still importing
        except OSError:
            data = b""
        self._close_conn()
        match = _PID_REPLY.fullmatch(data)
        if match is None:
            shown = data.decode(errors="replace")[:200] or "no answer"
            log.warning("warm template refused the interpreter (%s): starting one", shown)
            self.refused = True
            self._ended(1)
            return
        self.pid = int(match.group(1))
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except OSError:
            self._pidfd = None  # gone already, or no pidfds: /proc tells (`_gone`)

    def _gone(self) -> bool:
        if self._pidfd is not None:
            return bool(select.select([self._pidfd], [], [], 0)[0])
        return not running(self.pid or 0)

    def _ended(self, code: int) -> None:
        self.returncode = code
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _close_conn(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def request(
    path: str, title: str, env: dict[str, str], log_path: Path
) -> TemplateInterpreter | None:
    """Ask the template at `path` for a warm interpreter titled `title`, with `env`, this
    process's working directory and cores, its log appended to `log_path`; None when the
    template cannot be reached (start one as without it). Never waits for the template's
    imports: the interpreter says READY on its stdout once it is forked, as one started alone."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(CONNECT_S)
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    settings = {
        "title": title,
        "env": env,
        "cwd": os.getcwd(),
        "cores": sorted(os.sched_getaffinity(0)),
    }
    try:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(settings).encode()], [stdin_r, stdout_w, log_fd])
    except OSError as e:
        log.warning("warm template at %s not reached (%s): starting an interpreter", path, e)
        conn.close()
        for fd in (stdin_w, stdout_r):
            os.close(fd)
        return None
    finally:
        for fd in (stdin_r, stdout_w, log_fd):  # the interpreter's ends: the template has them
            os.close(fd)
    conn.setblocking(False)
    return TemplateInterpreter(conn, stdin_w, stdout_r)


# -- the template itself ------------------------------------------------------------------------


def _settings(data: bytes, fds: list[int], started: dict[str, str]) -> dict[str, Any]:
    """The request's settings, checked (ValueError says what is wrong); `started`: the
    template's environment as it started (`comparable`; its imports may add to it)."""
    if len(fds) != 3:
        raise ValueError(f"{len(fds)} descriptors, not 3")
    settings = json.loads(data)
    if not isinstance(settings, dict):
        raise ValueError("not a JSON object")
    title, env, cwd, cores = (settings.get(k) for k in ("title", "env", "cwd", "cores"))
    if not isinstance(title, str) or len(title) > 200:
        raise ValueError("bad title")
    if not isinstance(cwd, str) or not os.path.isdir(cwd):
        raise ValueError("bad working directory")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValueError("bad environment")
    if comparable(env) != started:
        differ = sorted({k for k, _ in set(comparable(env).items()) ^ set(started.items())})
        raise ValueError(f"environment differs from the template's: {differ[:5]}")
    if not isinstance(cores, list) or not all(isinstance(c, int) and c >= 0 for c in cores):
        raise ValueError("bad cores")
    return settings


def _become_interpreter(settings: dict[str, Any], fds: list[int]) -> int:
    """In the forked child: take on the agent's descriptors and settings, then serve forks."""
    import setproctitle

    from transom.control import warm  # the pool's module imports this one

    os.setsid()
    for target, fd in enumerate(fds):  # stdin, stdout, the log as stderr
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(settings["env"])
    os.chdir(settings["cwd"])
    try:
        os.sched_setaffinity(0, set(settings["cores"]) or os.sched_getaffinity(0))
    except OSError:
        pass  # cores gone meanwhile: the template's stand
    setproctitle.setproctitle(settings["title"])
    return warm.serve_forks()


def serve(path: str) -> int:
    """Listen at `path`, import, then fork a warm interpreter per request (returns in each
    interpreter, and in each worker it forks, with its exit code)."""
    import setproctitle

    from transom.control import warm

    setproctitle.setproctitle(f"{TITLE} ({path})")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # Before the imports: agents may hand in requests at once. Bound under another name and
    # renamed once it listens: a peer that finds `path` (Template.start waits for it) and
    # connects between a bind and its listen is refused, and its agent imports by itself.
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)
    started = comparable(dict(os.environ))
    warm.import_modules()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its interpreters are reaped by the kernel
    while True:
        conn, _ = listener.accept()
        conn.settimeout(REQUEST_S)  # a peer that connects and sends nothing holds nobody up
        fds: list[int] = []
        try:
            uid = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)[4:8]
            data, fds, _flags, _addr = socket.recv_fds(conn, MAX_REQUEST, 3)
            if int.from_bytes(uid, sys.byteorder) != os.getuid():
                raise ValueError("another user's request")
            settings = _settings(data, fds, started)
        except (OSError, ValueError) as e:
            log.warning("request refused: %s", e)
            _reply(conn, b"E " + str(e).encode()[:200])
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        try:
            pid = os.fork()
        except OSError as e:  # no process to spare now: that agent imports by itself
            pid = -1
            _reply(conn, b"E cannot fork: " + str(e).encode()[:200])
        if pid == 0:
            listener.close()
            conn.close()
            return _become_interpreter(settings, fds)
        for fd in fds:
            os.close(fd)
        if pid > 0:
            _reply(conn, b"P %d" % pid)
        conn.close()


def _reply(conn: socket.socket, message: bytes) -> None:
    try:
        conn.send(message)
    except OSError:
        pass  # the agent is gone: its interpreter reads a closed stdin and ends


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(serve(sys.argv[1]))


# -- the launcher's side ------------------------------------------------------------------------


class Template:
    """The template process a launcher runs for its nodes (`start`, `stop`), and `agent_env`,
    what its agents need to find it. Its socket is in a private directory of its own."""

    def __init__(self, job_id: str, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.env = env  # the launcher's own (None: this process's, when it starts)
        self.job_id = job_id
        self.log_path = log_path
        self.folder = Path(tempfile.mkdtemp(prefix="transom-warm-"))  # mode 0700
        self.socket_path = str(self.folder / "template.sock")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it with the environment the agents give their interpreters (warm.py), and wait
        (STARTED_S at most) until it listens: an agent that finds no socket imports by itself."""
        env = interpreter_env(os.environ if self.env is None else self.env, self.job_id)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-u", "-m", "transom.control.warm_template", self.socket_path],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                preexec_fn=new_session_dying_with_parent,
            )
        deadline = time.monotonic() + STARTED_S
        while not os.path.exists(self.socket_path) and self.process.poll() is None:
            if time.monotonic() > deadline:
                log.warning("warm template not listening after %.0f s", STARTED_S)
                return
            time.sleep(0.01)

    def agent_env(self) -> dict[str, str]:
        return {env_names.WARM_TEMPLATE: self.socket_path}

    def stop(self) -> None:
        """End it (the interpreters it forked are their agents' and end with them)."""
        if self.process is not None:
            self.process.kill()  # it holds nothing: no clean-up to wait for
            self.process.wait()
            self.process = None
        shutil.rmtree(self.folder, ignore_errors=True)
