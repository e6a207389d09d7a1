"""A worker's exit reaches the agent at once (transom/utils/exit_watch.py, WorkerGroup's
`on_exit`): for its own children and for workers the warm interpreter forked. Real processes."""

from __future__ import annotations

import os
import queue
import subprocess
import sys

import pytest

from transom.control.warm import WarmPool
from transom.control.workers import Assignment, WorkerGroup
from transom.utils.exit_watch import ExitWatch

pytestmark = [
    pytest.mark.integration,  # its tests start processes
    pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfds here"),
]


def test_the_callback_names_each_process_as_it_exits_even_one_that_is_not_a_child():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    # A grandchild: its parent (the shell) waits for it, we cannot.
    shell = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE)
    assert shell.stdout is not None
    grandchild = int(shell.stdout.readline())
    exits: queue.Queue[int] = queue.Queue()
    watch = ExitWatch([child.pid, grandchild], exits.put)
    try:
        assert exits.empty()
        os.kill(grandchild, 9)
        assert exits.get(timeout=10) == grandchild
        child.stdin.close()  # type: ignore[union-attr]
        assert exits.get(timeout=10) == child.pid
        assert watch.exited == {child.pid, grandchild}
    finally:
        watch.close()
        watch.close()  # a second close does nothing
        for p in (child, shell):
            p.kill()
            p.wait()


SCRIPT = "import sys, time\ntime.sleep(float(sys.argv[1]))\nsys.exit(int(sys.argv[2]))\n"


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_group_reports_an_exit_as_it_happens_and_poll_has_its_code(tmp_path, warm):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    assignment = Assignment(
        job_id="j", node_id="node0", generation=1, restart_count=0, max_restarts=0,
        group_rank=0, group_world_size=1, nproc_per_node=2,
        master_addr="127.0.0.1", master_port=1, host="127.0.0.1",
    )  # fmt: skip
    pool = WarmPool(2, {**os.environ, "TRANSOM_WARM_IMPORTS": "json"}, tmp_path / "w.log")
    if warm:
        pool.fill()
    group = WorkerGroup(assignment, str(script), ["0.3", "3"], tmp_path / "logs", {})
    exits: queue.Queue[int] = queue.Queue()
    try:
        group.start(pool if warm else None, on_exit=exits.put)
        assert group.poll()[0] == "running"
        pid = exits.get(timeout=30)  # both ranks exit with 3 after 0.3 s: the first of them
        state, failures = group.poll()  # at once: no tick's wait, and the code is there
        assert pid in {p.pid for p in group.processes}
        assert state == "failed" and failures and failures[0].exitcode == 3
    finally:
        group.stop(grace_s=2)
        pool.close()
