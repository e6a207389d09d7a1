"""The node agent's checkpoint server (control/ckpt_node.py): a real server process, restarted
when it dies, without the agent's loop waiting for it, and started again on a later tick when a
restart failed (the torture suite's server_kill_ckpt found a node that went on without a server
for the rest of the job once a server was killed again while it started); its etcd entries live
under the agent's lease, and a restarted server withdraws what the dead one listed."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from conftest import wait_for

from transom.checkpoint import catalog
from transom.common import files, keys
from transom.common.states import Tier
from transom.control.ckpt_node import RESTART_INTERVAL_S, NodeCheckpointServer
from transom.job_spec import JobSpec


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


def test_the_server_lists_under_the_agents_lease_and_its_successor_withdraws_its_listings(
    store, tmp_path: Path
):
    spec = JobSpec(script="train.py", job_id=store.job_id)
    node = NodeCheckpointServer(spec, store, "node0", tmp_path, "127.0.0.1")
    lease = store.lease(60)  # the agent's
    node.launch()
    node.use_lease(lease.id)  # as the agent's registration does, while the server starts
    node.start()
    memory = catalog.memory_holder("node0")

    def registered_under_the_lease() -> dict | None:
        found = store.client.get(store.key(keys.ckpt_server("node0")), metadata=True)
        ok = found and int(found[0][1].get("lease", 0)) == lease.id
        return json.loads(found[0][0]) if ok else None

    try:
        first = wait_for(registered_under_the_lease, 30, "the server registered")
        # A listing of the first server's memory (as a save would make), under the same lease.
        catalog.publish(store, memory, catalog.Listing(4, 0, Tier.MEMORY, node="node0"), lease)
        assert node.process is not None
        node.process.send_signal(signal.SIGKILL)
        node.process.wait()
        node.ensure_running()  # its successor, handed the same lease
        wait_for(
            lambda: (r := registered_under_the_lease()) and r["addr"] != first["addr"],
            30,
            "the successor registered under the agent's lease",
        )
        wait_for(lambda: not catalog.holders(store, 4, 0), 10, "the dead server's listing gone")
        assert store.refresh(lease)  # nobody revoked the agent's lease
    finally:
        node.stop()
        store.revoke(lease)
    assert store.get(keys.ckpt_server("node0")) is None  # withdrawn by the server's stop


def test_a_server_on_the_agents_lease_exits_cleanly_when_stopped(store, tmp_path: Path):
    """A daemon thread blocked on the lease pipe held a buffered stdin's lock, and the server's
    exit could abort ("Fatal Python error: ... could not acquire lock ... at interpreter
    shutdown", in the server logs of demo and torture runs); the pipe is read unbuffered."""
    spec = JobSpec(script="train.py", job_id=store.job_id)
    lease = store.lease(60)  # the agent's
    try:
        for i in range(3):
            node_id = f"node{i}"
            node = NodeCheckpointServer(spec, store, node_id, tmp_path, "127.0.0.1")
            node.launch()
            node.use_lease(lease.id)
            node.start()
            process = node.process
            assert process is not None
            try:
                wait_for(
                    lambda n=node_id: store.get(keys.ckpt_server(n)) is not None,
                    30,
                    "the server registered under the agent's lease",
                )
            finally:
                node.stop()
            assert process.returncode == 0
            assert (
                "Fatal Python error"
                not in files.log_file(tmp_path, f"ckpt-server-{node_id}").read_text()
            )
    finally:
        store.revoke(lease)
