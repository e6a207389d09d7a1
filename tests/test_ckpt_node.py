"""The node agent's checkpoint server (control/ckpt_node.py): a real server process, restarted
when it dies, and started again on a later tick when a restart failed (the torture suite's
server_kill_ckpt found a node that went on without a server for the rest of the job once a
server was killed again while it started)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest
from conftest import wait_for

from transom.config import JobSpec
from transom.control.ckpt_node import NodeCheckpointServer


def test_a_failed_restart_is_retried_on_the_next_tick(store, tmp_path: Path) -> None:
    spec = JobSpec(script="train.py", job_id=store.job_id)
    node = NodeCheckpointServer(spec, store, "node0", tmp_path, "127.0.0.1")
    node.start()
    try:
        first = node.process
        assert first is not None
        first.send_signal(signal.SIGKILL)
        first.wait()
        # The restarted server is killed too before it serves: the restart fails.
        stop = threading.Event()

        def kill_the_next_one() -> None:
            while not stop.wait(0.005):
                process = node.process
                if process is not None and process is not first:
                    process.send_signal(signal.SIGKILL)
                    return

        killer = threading.Thread(target=kill_the_next_one, daemon=True)
        killer.start()
        with pytest.raises(RuntimeError, match="did not start"):
            node.ensure_running()
        stop.set()
        killer.join()
        node.ensure_running()  # the next tick
        assert node.process is not None and node.process.poll() is None
        wait_for(node._serving, 30, "the server to serve")
    finally:
        node.stop()
    assert not node.shm_dir.exists()
