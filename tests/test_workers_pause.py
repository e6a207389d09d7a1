"""A paused worker group runs no instruction until resumed, and a paused group that is stopped is
killed without running again (its SIGTERM handler never runs). Real processes, no etcd."""

from __future__ import annotations

import signal

import psutil
import pytest
from conftest import wait_for

from transom.control.workers import Assignment, WorkerGroup

pytestmark = pytest.mark.integration  # its tests start processes

# Appends a line every 10 ms; on SIGTERM writes TERM and exits (what a graceful stop would run).
SCRIPT = """
import signal, sys, time
out = open(sys.argv[1], "a", buffering=1)
signal.signal(signal.SIGTERM, lambda *_: (out.write("TERM\\n"), sys.exit(0)))
while True:
    out.write("tick\\n")
    time.sleep(0.01)
"""


@pytest.fixture
def group(tmp_path):
    script = tmp_path / "ticker.py"
    script.write_text(SCRIPT)
    out = tmp_path / "ticks.txt"
    assignment = Assignment(
        job_id="j", node_id="node0", generation=1, restart_count=0, max_restarts=0,
        group_rank=0, group_world_size=1, nproc_per_node=2,
        master_addr="127.0.0.1", master_port=1, host="127.0.0.1",
    )  # fmt: skip
    g = WorkerGroup(assignment, str(script), [str(out)], tmp_path / "logs", {})
    g.start()
    try:
        yield g, out
    finally:
        g.paused_at = None  # a plain stop: SIGCONT, SIGTERM, SIGKILL
        g.stop(grace_s=2)


def lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def stopped(g: WorkerGroup) -> bool:
    return all(psutil.Process(p.pid).status() == psutil.STATUS_STOPPED for p in g.processes)


def pause_ticking(g: WorkerGroup, out) -> int:
    """Pause the group once both workers tick; the lines written when every worker stopped."""
    wait_for(lambda: len(lines(out)) >= 20, 30, "both workers ticking")
    g.pause(now=0.0)
    wait_for(lambda: stopped(g), 5, "every worker stopped")
    return len(lines(out))


def test_a_paused_group_runs_nothing_until_resumed(group):
    g, out = group
    frozen = pause_ticking(g, out)
    # a stopped process executes nothing: wait the time of 30 ticks for any sign of life
    psutil.wait_procs([psutil.Process(p.pid) for p in g.processes], timeout=0.3)
    assert len(lines(out)) == frozen and g.poll()[0] == "running"
    g.resume()
    assert g.paused_at is None
    wait_for(lambda: len(lines(out)) >= frozen + 10, 10, "the workers ticking again")


def test_a_paused_group_that_is_stopped_is_killed_without_running_again(group):
    g, out = group
    frozen = pause_ticking(g, out)
    g.stop()
    assert [p.returncode for p in g.processes] == [-signal.SIGKILL] * 2
    assert len(lines(out)) == frozen and "TERM" not in lines(out)


def test_an_unpaused_stop_is_graceful(group):
    g, out = group
    wait_for(lambda: len(lines(out)) >= 20, 30, "both workers ticking")
    g.stop(grace_s=5)
    assert [p.returncode for p in g.processes] == [0, 0]
    assert lines(out).count("TERM") == 2
