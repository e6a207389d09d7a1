"""End-to-end: the control plane rides out its own faults (issue 11), on real jobs.

- etcd paused (SIGSTOP) for longer than the node TTL: every lease may expire at once on resume;
  that is a control-plane incident, not node deaths: no restart, no eviction, the job succeeds.
- SIGTERM (what Slurm and Kubernetes send) to an agent: it exits 0 within 30 s, deregistered,
  its workers stopped, no shared memory left behind; the job goes on without it. (SIGTERM to a
  controller: tests/test_agent_unreachable.py.)
"""

from __future__ import annotations

import contextlib
import signal
import time

import psutil
import pytest
from conftest import TOY, wait_for

from transom.checkpoint.shm_dirs import default_shm_dir
from transom.control.contact import LEADER_TTL_S

pytestmark = pytest.mark.slow

TTL_S = 2  # --node-ttl: a short lease, so a pause a few seconds long outlives it
# Longer than the TTL and than the leader's lease: the standby, which saw no gap of its own,
# takes the lead and must still excuse the leases etcd revoked on resuming.
PAUSE_S = LEADER_TTL_S + 1.5


def etcd_of(job) -> psutil.Process:
    def find():
        for p in psutil.process_iter(["cmdline"]):
            argv = p.info["cmdline"] or []
            if argv and argv[0].endswith("etcd") and str(job.run_dir) in " ".join(argv):
                return p
        return None

    return wait_for(find, 30, "the job's etcd")


def process_of(job, marker: str) -> psutil.Process:
    """The launcher's child (an agent or a controller candidate) whose command line has `marker`."""

    def find():
        for p in psutil.Process(job.process.pid).children():
            try:
                if marker in " ".join(p.cmdline()):
                    return p
            except psutil.NoSuchProcess:
                continue
        return None

    def seen() -> str:
        """What the launcher runs instead, and the end of each agent's log."""
        children = []
        for p in psutil.Process(job.process.pid).children():
            with contextlib.suppress(psutil.Error):
                children.append(" ".join(p.cmdline()[3:8]))
        logs = {
            path.name: path.read_text(errors="replace")[-600:]
            for path in sorted((job.run_dir / "logs").glob("agent-*.log"))
        }
        return f"{marker} among the launcher's children {children}; agents' logs: {logs}"

    return wait_for(find, 30, seen)


def test_etcd_paused_longer_than_the_node_ttl_costs_no_restart_and_no_eviction(start_job):
    job = start_job(
        "--nnodes", "2", "--spares", "1", "--node-ttl", str(TTL_S),
        TOY, "--steps", "70", "--step-delay", "0.15",
    )  # fmt: skip
    wait_for(lambda: "step 10 " in job.log_text(), 90, "training to reach step 10")
    etcd = etcd_of(job)
    etcd.send_signal(signal.SIGSTOP)
    try:
        time.sleep(PAUSE_S)  # the fault itself: etcd answers nobody for this long
    finally:
        etcd.send_signal(signal.SIGCONT)
    assert job.wait() == 0, job.output
    record = job.status()["job"]
    assert record["restarts_used"] == 0 and record["generation"] == 1
    assert record["evicted"] == {}
    kinds = [e["kind"] for e in job.events()]
    assert "incident" not in kinds and "evict" not in kinds


def test_sigterm_to_an_agent_leaves_cleanly_and_the_job_goes_on(start_job):
    job = start_job("--nnodes", "2", "--spares", "1", TOY, "--steps", "80", "--step-delay", "0.15")
    wait_for(lambda: "step 5 " in job.log_text(), 90, "training to reach step 5")
    agent = process_of(job, "--node-id node1")
    workers = [wait_for(lambda: job.worker(1), 10, "node1's worker (rank 1)")]
    shm = default_shm_dir(job.job_id, "node1")
    assert shm.exists()
    agent.send_signal(signal.SIGTERM)
    agent.wait(timeout=30)  # psutil cannot tell another process's exit code: the log says it
    agent_log = (job.run_dir / "logs" / "agent-node1.log").read_text()
    assert "agent of node1 exits with code 0" in agent_log
    assert not shm.exists(), "the checkpoint server's shared memory was left behind"
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    wait_for(lambda: "node1" in job.status().get("job", {}).get("evicted", {}), 30, "eviction")
    assert job.wait() == 0, job.output
    events = job.events()
    assert any("node1 left the job: SIGTERM" in e["message"] for e in events)
    record = job.status()["job"]
    assert record["state"] == "SUCCEEDED" and record["restarts_used"] == 1
