"""An agent or controller whose etcd cannot be reached at all: no traceback, no "bad input".

A control-plane fault is never exit code 2 (what the command line uses for bad input): the
agent retries start-up for `fence.STARTUP_WAIT_S`, then exits 1 saying what it could not do,
having closed everything it started. No etcd is started: the store's port is closed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import wait_for

from transom.control import fence
from transom.control.agent import NodeAgent
from transom.control.controller import Controller
from transom.monitor import stacks
from transom.store import Store
from transom.utils.net import free_port


def dead_store() -> Store:
    """A store whose port is closed; each call gives up after a second of retries (a stop is
    seen between calls)."""
    return Store(f"http://127.0.0.1:{free_port()}", "j-unreachable", timeout=0.5, deadline_s=1.0)


def test_an_agent_that_never_reaches_etcd_gives_up_with_exit_1_not_bad_input(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(fence, "STARTUP_WAIT_S", 1.5)
    agent = NodeAgent(dead_store(), "node0", tmp_path)
    started = time.monotonic()
    assert agent.run() == 1
    assert time.monotonic() - started < 15
    assert "cannot read the job spec" in caplog.text
    assert agent.stopping.is_set() and agent.lease is None


def test_an_agent_asked_to_stop_while_waiting_for_etcd_stops_at_once(tmp_path):
    agent = NodeAgent(dead_store(), "node0", tmp_path)
    threading.Timer(1.0, agent.stopping.set).start()
    started = time.monotonic()
    assert agent.run() == 1  # stopped before it ever served: not a success
    assert time.monotonic() - started < 5


def test_a_controller_that_cannot_reach_etcd_keeps_trying_until_stopped(caplog):
    controller = Controller(dead_store(), "controller-test")
    controller.terminated = True  # as SIGTERM sets it (signals reach the main thread only)
    threading.Timer(2.0, controller.stopping.set).start()
    assert controller.run() == 0
    assert "cannot read the job spec yet" in caplog.text


@pytest.mark.integration
@pytest.mark.parametrize("role", ["agent", "controller"])
def test_sigterm_ends_an_agent_or_controller_with_exit_0_even_while_etcd_is_unreachable(
    role, tmp_path
):
    store = f"http://127.0.0.1:{free_port()}"
    who = ["--node-id", "node0", "--run-dir", str(tmp_path)] if role == "agent" else []
    if role == "controller":
        who = ["--candidate-id", "controller-test"]
    argv = [sys.executable, "-m", "transom", "--log-level", "info", role, "--store", store]
    process = subprocess.Popen(
        [*argv, "--job-id", "j-sigterm", *who],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # It catches SIGTERM from the moment it starts serving, which begins with waiting for
        # etcd: signalled earlier, it would die of the signal's default action.
        wait_for(lambda: stacks.catches(process.pid, signal.SIGTERM), 60, "a SIGTERM handler")
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0, output
    assert "exits with code 0" in output
