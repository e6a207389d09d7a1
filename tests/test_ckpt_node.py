"""The node agent's checkpoint server (control/ckpt_node.py): a real server process, restarted
when it dies, without the agent's loop waiting for it, and started again on a later tick when a
restart failed (the torture suite's server_kill_ckpt found a node that went on without a server
for the rest of the job once a server was killed again while it started); its etcd entries live
under the agent's lease, and a restarted server withdraws what the dead one listed."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from conftest import wait_for

from transom.checkpoint import catalog
from transom.checkpoint.shm_dirs import default_shm_dir
from transom.common import keys
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
        catalog.publish(store, 4, 0, memory, {"tier": "memory", "node": "node0"}, lease)
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


# A node agent's stand-in: starts the node's checkpoint server under the lease it is given, says
# the server's pid, and waits to be killed.
AGENT_STAND_IN = """
import argparse, sys, threading
from transom.config import JobSpec
from transom.control.ckpt_node import NodeCheckpointServer
from transom.store import Store
from transom.store.access import add_store_options, from_args
parser = argparse.ArgumentParser()
add_store_options(parser, required=True)
parser.add_argument("job_id")
parser.add_argument("lease_id", type=int)
parser.add_argument("run_dir")
args = parser.parse_args()
store = Store(from_args(args), args.job_id)
node = NodeCheckpointServer(JobSpec(script="train.py", job_id=args.job_id), store, "node0",
                            args.run_dir, "127.0.0.1")
node.launch()
node.use_lease(args.lease_id)
node.start()
print(node.process.pid, flush=True)
threading.Event().wait()
"""


def test_a_server_whose_agent_dies_ends_the_agents_lease_at_once(store, tmp_path: Path):
    lease = store.lease(60)  # the agent's: by itself it would outlive this test
    store.put(keys.node("node0"), {"node": "node0"}, lease=lease)  # the node's registration
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT_STAND_IN, *store.access.argv()]
        + [store.job_id, str(lease.id), str(tmp_path)],
        stdout=subprocess.PIPE,
    )
    server_pid = None
    try:
        assert agent.stdout is not None
        server_pid = int(agent.stdout.readline())

        def server_registered() -> bool:
            found = store.client.get(store.key(keys.ckpt_server("node0")), metadata=True)
            return bool(found) and int(found[0][1].get("lease", 0)) == lease.id

        wait_for(server_registered, 30, "the server to take the agent's lease")
        agent.kill()  # the agent dies; its server is told by its death signal
        agent.wait()
        wait_for(
            lambda: store.get(keys.node("node0")) is None,
            20,
            "the node's registration to go with the agent's lease, long before its TTL",
        )
        wait_for(lambda: not psutil.pid_exists(server_pid), 20, "the server to exit")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        if server_pid is not None and psutil.pid_exists(server_pid):
            psutil.Process(server_pid).kill()
        shutil.rmtree(default_shm_dir(store.job_id, "node0"), ignore_errors=True)
