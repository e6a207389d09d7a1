"""The node agent's checkpoint server (control/ckpt_node.py): a real server process, restarted
when it dies, without the agent's loop waiting for it, and started again on a later tick when a
restart failed (the torture suite's server_kill_ckpt found a node that went on without a server
for the rest of the job once a server was killed again while it started)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from conftest import wait_for

from transom.config import JobSpec
from transom.control.ckpt_node import RESTART_INTERVAL_S, NodeCheckpointServer


def test_a_dead_server_is_started_again_without_holding_up_the_agent(store, tmp_path: Path):
    spec = JobSpec(script="train.py", job_id=store.job_id)
    node = NodeCheckpointServer(spec, store, "node0", tmp_path, "127.0.0.1")
    node.start()
    try:
        first = node.process
        assert first is not None and node.serving
        first.send_signal(signal.SIGKILL)
        first.wait()
        node.ensure_running()  # it had served: a new one at once, not waited for
        launched = time.monotonic()
        second = node.process
        assert second is not None and second is not first and not node.serving
        # The new server is killed too before it serves: a failed start, retried no faster
        # than every RESTART_INTERVAL_S, never given up.
        second.send_signal(signal.SIGKILL)
        second.wait()
        node.ensure_running()
        assert node.process is second or time.monotonic() - launched >= RESTART_INTERVAL_S

        def serving() -> bool:
            node.ensure_running()  # the agent's ticks
            return node.serving

        wait_for(serving, 30 + RESTART_INTERVAL_S, "a third server to serve")
        assert node.process is not second and node.process.poll() is None
    finally:
        node.stop()
    assert not node.shm_dir.exists()
