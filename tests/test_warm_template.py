"""The machine's warm template (transom.control.warm_template): each node's warm interpreter is
forked from one process's imports, serves its agent as one started alone would, and ends with
its agent; a request the template cannot serve leaves the agent to start its own."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import psutil
import pytest
from conftest import REPO, wait_for

from transom.common import env as env_names
from transom.control.warm import WarmPool
from transom.control.warm_template import Template, interpreter_env
from transom.utils.procs import running

pytestmark = pytest.mark.integration  # real processes: the template, interpreters, workers

SCRIPT = "import sys, time\ntime.sleep(float(sys.argv[1]))\n"


@pytest.fixture
def template(tmp_path, monkeypatch):
    monkeypatch.setenv(env_names.WARM_IMPORTS, "json")  # the test's imports: quick
    template = Template("job-t", tmp_path / "template.log", launcher_env())
    template.start()
    yield template
    template.stop()


def launcher_env() -> dict[str, str]:
    """This process's environment, less what pytest changes between a test's phases."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def agent_env(template: Template) -> dict[str, str]:
    """An agent's warm environment, as transom.control.agent builds it under this launcher."""
    return {**interpreter_env(launcher_env(), "job-t"), **template.agent_env()}


def launch(pool: WarmPool, tmp_path, seconds: float = 0.0):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    wait_for(lambda: pool.warm_count() == 1, 30, "the interpreter's imports")
    worker = pool.launch([str(script), str(seconds)], dict(os.environ), tmp_path / "w.log")
    assert worker is not None
    return worker


def test_two_nodes_interpreters_are_forked_from_the_template_and_serve_their_agents(
    template, tmp_path
):
    pools = [WarmPool(1, agent_env(template), tmp_path / f"warm{i}.log", f"n{i}") for i in (0, 1)]
    try:
        for pool in pools:
            pool.fill()
        for i, pool in enumerate(pools):
            worker = launch(pool, tmp_path)
            assert worker.wait(timeout=30) == 0 and pool.last_launch == "warm"
            interpreter = pool.interpreter
            assert interpreter is not None and interpreter.pid is not None
            assert template.process is not None
            assert psutil.Process(interpreter.pid).ppid() == template.process.pid
            title = " ".join(psutil.Process(interpreter.pid).cmdline())
            assert f"node n{i}" in title, title
            assert psutil.Process(interpreter.pid).cwd() == os.getcwd()
    finally:
        for pool in pools:
            pool.close()
    for pool in pools:  # closed: gone
        assert pool.interpreter is None


AGENT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    sys.path[:0] = [sys.argv[3], sys.argv[4]]
    from conftest import wait_for
    from transom.control.warm import WarmPool
    pool = WarmPool(1, dict(os.environ), Path(sys.argv[1]) / "warm.log")
    pool.fill()
    wait_for(lambda: pool.warm_count() == 1, 60, "imports")
    worker = pool.launch([sys.argv[2], "600"], dict(os.environ), Path(sys.argv[1]) / "w.log")
    print(json.dumps({"interpreter": pool.interpreter.pid, "worker": worker.pid}), flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def torch_template(tmp_path):
    """A template that imports torch, as a job's does (an interpreter holding it is slow to
    tear down: its end must not wait for that)."""
    template = Template("job-t", tmp_path / "template.log", launcher_env())
    template.start()
    yield template
    template.stop()


def test_an_agents_death_ends_its_interpreter_and_workers_at_once(torch_template, tmp_path):
    template = torch_template
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path), str(script), str(REPO / "tests"), str(REPO)],
        env=agent_env(template),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout is not None
        pids = json.loads(agent.stdout.readline())
        assert template.process is not None
        assert psutil.Process(pids["interpreter"]).ppid() == template.process.pid
        assert running(pids["worker"])
        agent.kill()  # SIGKILL: its end of the interpreter's stdin closes with it
        wait_for(
            lambda: not running(pids["interpreter"]) and not running(pids["worker"]),
            0.5,
            "the interpreter and its worker to end with their agent",
            interval=0.01,
        )
    finally:
        agent.kill()
        agent.wait()
        for pid in (pids.get("worker"), pids.get("interpreter")) if "pids" in locals() else ():
            if pid and running(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_environment_that_differs_is_refused_and_the_agent_imports_itself(
    template, tmp_path, caplog
):
    env = {**agent_env(template), "OMP_NUM_THREADS": "3"}  # read by torch at import
    pool = WarmPool(1, env, tmp_path / "warm.log")
    try:
        pool.fill()

        def refused() -> bool:
            pool.warm_count()  # what an agent asks now and then: it takes the refusal in
            return pool.template is None

        wait_for(refused, 30, "the template's refusal")
        worker = launch(pool, tmp_path)
        assert worker.wait(timeout=30) == 0
        interpreter = pool.interpreter
        assert isinstance(interpreter, subprocess.Popen)  # its own, started cold
        assert "environment differs from the template's: ['OMP_NUM_THREADS']" in caplog.text
    finally:
        pool.close()


def test_without_a_template_the_agent_starts_its_own(tmp_path):
    env = {**os.environ, env_names.WARM_TEMPLATE: str(tmp_path / "none.sock")}
    env[env_names.WARM_IMPORTS] = "json"
    pool = WarmPool(1, env, tmp_path / "warm.log")
    try:
        pool.fill()
        assert pool.template is None and isinstance(pool.interpreter, subprocess.Popen)
        assert launch(pool, tmp_path).wait(timeout=30) == 0
    finally:
        pool.close()


def ask(path: str, payload: bytes, fds: list[int]) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(30)
        conn.connect(path)
        socket.send_fds(conn, [payload], fds)
        return conn.recv(256)


def test_forged_requests_are_refused_and_the_template_keeps_serving(template, tmp_path):
    null = os.open(os.devnull, os.O_RDWR)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    silent.connect(template.socket_path)  # connects, sends nothing: the template moves on
    try:
        assert ask(template.socket_path, b"not json", [null, null, null]).startswith(b"E ")
        settings = {"title": "x", "env": agent_env(template), "cwd": os.getcwd(), "cores": [0]}
        good = json.dumps(settings).encode()
        assert ask(template.socket_path, good, [null]).startswith(b"E 1 descriptors")
        bad = dict(settings, env={"A": 1})
        assert ask(template.socket_path, json.dumps(bad).encode(), [null] * 3).startswith(b"E ")
        bad = dict(settings, cwd=str(tmp_path / "missing"))
        assert ask(template.socket_path, json.dumps(bad).encode(), [null] * 3).startswith(b"E ")
    finally:
        os.close(null)
        silent.close()
    pool = WarmPool(1, agent_env(template), tmp_path / "warm.log")
    try:
        pool.fill()
        assert launch(pool, tmp_path).wait(timeout=30) == 0
        assert pool.template is not None  # served by the template after all that
    finally:
        pool.close()
