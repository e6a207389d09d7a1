"""End-to-end tests of `transom run` with real etcd, real agents, real DDP workers, real kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import TOY, agent_process, job_processes, wait_for

from transom import launcher, run_mirror
from transom.common import env, keys
from transom.store import EmbeddedEtcd, Store

pytestmark = pytest.mark.slow


def kinds(job) -> list[str]:
    return [e["kind"] for e in job.events()]


def test_healthy_job_completes_with_the_right_world(start_job):
    job = start_job("--nnodes", "2", "--nproc-per-node", "2", "--spares", "1", TOY, "--steps", "5")
    assert job.wait() == 0, job.output
    logs = job.log_text()
    for rank in range(4):
        assert f"world rank={rank} world_size=4" in logs
    assert "group_rank=1" in logs and "local_rank=1" in logs
    assert logs.count("done rank=") == 4
    status = job.status()
    assert status["job"]["state"] == "SUCCEEDED"
    assert status["job"]["generation"] == 1
    assert "succeeded" in kinds(job)


def test_killed_worker_restarts_and_job_completes(start_job):
    job = start_job("--nnodes", "3", "--spares", "1", TOY, "--steps", "40", "--step-delay", "0.15")
    wait_for(lambda: "step 5 " in job.log_text(), 60, "training to reach step 5")
    victim = wait_for(lambda: job.worker(1), 10, "the rank 1 worker")
    victim.send_signal(signal.SIGKILL)
    assert job.wait() == 0, job.output
    events = job.events()
    diagnosis = next(e for e in events if e["kind"] == "diagnosis")
    assert "SIGKILL" in diagnosis["message"] and diagnosis["blamed"] == ["node1"]
    assert job.status()["job"]["generation"] == 2
    assert job.status()["job"]["restarts_used"] == 1
    assert "restart=1" in job.log_text("g002/rank1.log")
    assert "done rank=1" in job.log_text("g002/rank1.log")
    assert "evict" not in kinds(job)  # a first failure restarts in place


def test_dead_node_is_replaced_by_the_spare(start_job):
    job = start_job("--nnodes", "3", "--spares", "1", TOY, "--steps", "40", "--step-delay", "0.15")
    wait_for(lambda: "step 5 " in job.log_text(), 60, "training to reach step 5")
    agent = wait_for(lambda: agent_process(job.job_id, "node1"), 10, "node1's agent")
    agent.send_signal(signal.SIGKILL)
    assert job.wait() == 0, job.output
    job_record = job.status()["job"]
    assert job_record["members"] == ["node0", "node2", "node3"]
    assert job_record["restarts_used"] == 1  # one incident, one restart
    assert "spare" in kinds(job)
    # found lost when its lease expired, or sooner (decisions.SILENT_AGENT_S) when its peers'
    # workers failed on it and its agent said nothing
    (diagnosis,) = [e for e in job.events() if e["kind"] == "diagnosis"]
    assert diagnosis["blamed"] == ["node1"] and diagnosis["lost"] == ["node1"]
    out = subprocess.run(
        [sys.executable, "-m", "transom", "status", "--run-dir", str(job.run_dir)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and "SUCCEEDED" in out.stdout, out.stdout


def test_killed_controller_leader_is_replaced(start_job):
    job = start_job("--nnodes", "2", TOY, "--steps", "40", "--step-delay", "0.15")
    wait_for(lambda: "step 3 " in job.log_text(), 60, "training to reach step 3")
    leader = wait_for(lambda: job.status().get("leader"), 10, "a leader in status.json")
    process = wait_for(
        lambda: next(
            (
                p
                for p in job_processes(job.job_id)
                if f"--candidate-id {leader}" in " ".join(p.cmdline())
            ),
            None,
        ),
        10,
        "the leader's process",
    )
    process.send_signal(signal.SIGKILL)
    assert job.wait() == 0, job.output
    leaders = [e["controller"] for e in job.events() if e["kind"] == "leader"]
    assert leaders[0] == leader and len(leaders) >= 2 and leaders[-1] != leader
    assert job.status()["job"]["state"] == "SUCCEEDED"


# "in turn": one node starts 4 s late, a different one each generation (an interpreter still
# importing torch), so each generation ends on the other rank's error alone (CI's run, stop 25).
LATE_START = f"""import os, time
if (int(os.environ["{env.GENERATION}"]) + int(os.environ["RANK"])) % 2:
    time.sleep(4)
"""


@pytest.mark.parametrize("timing", ["at once", "in turn"])
def test_same_error_on_every_rank_fails_fast(start_job, tmp_path, timing):
    script = tmp_path / "broken.py"
    late = LATE_START if timing == "in turn" else ""
    script.write_text(late + "raise ValueError('bad config value')\n")
    job = start_job("--nnodes", "2", "--max-restarts", "10", script)
    assert job.wait() == 1
    last = job.output.splitlines()[-1]
    assert "same error twice" in last and "ValueError: bad config value" in last
    # Not ten: one retry, however the ranks' start-up times fall (at once on a busy machine, one
    # rank may still be starting when the other's error ends the generation: CI's run, stop 32).
    assert job.status()["job"]["restarts_used"] == 1


def test_restart_budget_is_enforced(start_job, tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '0' else 0)\n")
    job = start_job("--nnodes", "2", "--max-restarts", "1", "--evict-window", "0", script)
    assert job.wait() == 1
    assert "restart budget spent" in job.output
    assert job.status()["job"]["restarts_used"] == 2


def test_without_spares_the_job_shrinks_to_its_minimum_or_fails(start_job):
    elastic = start_job("--nnodes", "1:2", TOY, "--steps", "40", "--step-delay", "0.15")
    rigid = start_job("--nnodes", "2", TOY, "--steps", "40", "--step-delay", "0.15")
    for job in (elastic, rigid):
        wait_for(lambda job=job: "step 3 " in job.log_text(), 90, "training to reach step 3")
        agent = wait_for(lambda job=job: agent_process(job.job_id, "node1"), 10, "node1's agent")
        agent.send_signal(signal.SIGKILL)
    assert elastic.wait() == 0, elastic.output
    assert "world_size=1" in elastic.log_text("g002/*.log")
    assert rigid.wait() == 1
    assert "not enough nodes" in rigid.output


def test_ctrl_c_stops_everything(start_job):
    job = start_job("--nnodes", "2", TOY, "--steps", "1000", "--step-delay", "0.2")
    wait_for(lambda: "step 2 " in job.log_text(), 60, "training to start")
    job.process.send_signal(signal.SIGINT)
    assert job.wait(60) == 130
    wait_for(lambda: not job_processes(job.job_id), 10, "every process of the job to end")


def test_machines_of_one_job_organise_through_an_existing_etcd(start_job, tmp_path):
    """Two `transom run --store` launchers ("machines") form a 2-node job; one controller leads."""
    with EmbeddedEtcd(tmp_path / "etcd") as etcd:
        common = [*etcd.access.argv(), "--nnodes", "2", TOY, "--steps", "5"]
        first = start_job("--node-id", "alpha", *common)
        second = start_job("--node-id", "beta", *common, job_id=first.job_id)
        assert first.wait() == 0, first.output
        assert second.wait() == 0, second.output
        assert "world_size=2" in first.log_text() + second.log_text()
        leaders = {e["controller"] for e in first.events() if e["kind"] == "leader"}
        assert len(leaders) == 1


def _candidates(job_id: str) -> list[str]:
    """The candidate ids of the job's live controller processes (all machines: one host here)."""
    found = []
    for p in job_processes(job_id):
        try:
            words = p.cmdline()
        except psutil.Error:
            continue
        if "controller" in words and "--candidate-id" in words:
            found.append(words[words.index("--candidate-id") + 1])
    return sorted(found)


def _roles(machine) -> dict[str, list[int]]:
    """The pids of what one machine's launcher started, by what `ps` shows them as."""
    roles: dict[str, list[int]] = {"agent": [], "server": [], "controller": [], "worker": []}
    for p in psutil.Process(machine.process.pid).children(recursive=True):
        try:
            words = p.cmdline()
        except psutil.Error:
            continue
        if "transom.checkpoint.server" in words:
            roles["server"].append(p.pid)
        elif "controller" in words and "--candidate-id" in words:
            roles["controller"].append(p.pid)
        elif "agent" in words and "transom" in words:
            roles["agent"].append(p.pid)
        elif str(TOY) in " ".join(words):  # a worker's title: setproctitle, one string
            roles["worker"].append(p.pid)
    return roles


def test_only_the_first_nodes_run_candidates_and_a_dead_ones_next_is_promoted(start_job, tmp_path):
    """Four machines, --controllers 2: controllers on 2 of them only; the leader's machine dies
    (its launcher and everything it started): a third machine's node is promoted, the job goes
    on."""
    with EmbeddedEtcd(tmp_path / "etcd") as etcd:
        common = [*etcd.access.argv(), "--controllers", "2", "--nnodes", "3", "--spares", "1"]
        script = [TOY, "--steps", "60", "--step-delay", "0.15"]
        machines = {"m0": start_job("--node-id", "m0", "--no-mirror", *common, *script)}
        for node in ("m1", "m2", "m3"):
            mirror = [] if node == "m3" else ["--no-mirror"]  # m3 mirrors the job
            machines[node] = start_job(
                "--node-id", node, *mirror, *common, *script, job_id=machines["m0"].job_id
            )
        store = Store(etcd.access, machines["m0"].job_id)
        node_of = lambda candidate: candidate.split("-")[1]  # noqa: E731  controller-<node>-<n>
        nodes = lambda: sorted(node_of(c) for c in _candidates(store.job_id))  # noqa: E731
        # the first two nodes to register, once all four did
        first = wait_for(
            lambda: (
                len(live := store.get_prefix(keys.NODES)) == 4
                and sorted(sorted(live, key=lambda n: live[n]["since"])[:2])
            ),
            60,
            "4 registered nodes",
        )
        wait_for(lambda: nodes() == first, 60, lambda: f"{first}'s only: {nodes()}")
        logs = lambda: "".join(m.log_text() for m in machines.values())  # noqa: E731
        wait_for(lambda: "step 5 " in logs(), 90, "training to reach step 5")
        # What `ps` shows of each machine: its agent, its checkpoint server, its workers (not
        # on the spare), and a controller only on the candidates' machines (issue 44).
        roles = wait_for(
            lambda: (
                (r := {node: _roles(machine) for node, machine in machines.items()})
                and sum(bool(r[n]["worker"]) for n in r) == 3
                and r
            ),
            30,
            "a worker on each of the 3 members",
        )
        for node, seen in roles.items():
            assert (len(seen["agent"]), len(seen["server"])) == (1, 1), (node, seen)
            assert len(seen["controller"]) == (1 if node in first else 0), (node, seen)
        leader = wait_for(
            lambda: (c := store.get(keys.LEADER)) and node_of(c) in first and c,
            30,
            lambda: f"a leader on {first}: {store.get(keys.LEADER)}",
        )
        victim = machines[node_of(leader)]
        os.killpg(victim.process.pid, signal.SIGKILL)  # the machine is lost
        victim.process.wait()
        survivor = next(n for n in first if n != node_of(leader))
        wait_for(
            lambda: len(nodes()) == 2 and survivor in nodes() and node_of(leader) not in nodes(),
            60,
            lambda: f"a third node promoted beside {survivor}: {nodes()}",
        )
        wait_for(
            lambda: (c := store.get(keys.LEADER)) and node_of(c) in nodes(),
            30,
            lambda: f"a new leader: {store.get(keys.LEADER)}",
        )
        for node, machine in machines.items():
            if machine is not victim:
                assert machine.wait(300) == 0, (node, machine.output)


def _embedded_etcd(job) -> psutil.Process | None:
    """The job's live embedded etcd (its data directory is in the run directory)."""
    for p in job_processes(str(job.run_dir)):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.cmdline()[0].endswith("/etcd"):
                return p
        except (psutil.Error, IndexError):
            continue
    return None


def test_a_killed_embedded_etcd_is_restarted_and_the_job_goes_on(start_job):
    job = start_job("--nnodes", "2", "--spares", "1", TOY, "--steps", "40", "--step-delay", "0.15")
    wait_for(lambda: "step 5 " in job.log_text(), 60, "training to reach step 5")
    first = wait_for(lambda: _embedded_etcd(job), 10, "the embedded etcd")
    first.send_signal(signal.SIGKILL)
    wait_for(
        lambda: (p := _embedded_etcd(job)) is not None and p.pid != first.pid,
        30,
        "a new embedded etcd",
    )
    assert job.wait() == 0, job.output
    assert job.status()["job"]["restarts_used"] == 0
    assert "evict" not in kinds(job) and "incident" not in kinds(job)
    assert any("restarted from its data" in e["message"] for e in job.events())


def test_sigterm_stops_everything_within_a_schedulers_grace(start_job):
    job = start_job("--nnodes", "2", "--spares", "1", TOY, "--steps", "1000", "--step-delay", "0.2")
    wait_for(lambda: "step 2 " in job.log_text(), 60, "training to start")
    start = time.monotonic()
    job.process.send_signal(signal.SIGTERM)
    assert job.wait(30) == 143
    assert time.monotonic() - start < 30
    wait_for(lambda: not job_processes(job.job_id), 10, "every process of the job to end")


def test_the_launcher_rides_out_an_etcd_stall_and_logs_it_once(start_job):
    """etcd paused long enough that one of the launcher's reads of the job record (one every
    run_mirror.PROBE_S; the rest comes pushed) begins in the stall and passes its deadline
    there; node leases of 20 s outlast it and the agents' pause (at 3/4 of the TTL) does not
    come (leases that expire in a stall are the agents' and controller's concern, not the
    launcher's). The launcher logs the outage once when it begins and once when it ends, and
    records an event; the job goes on without a restart."""
    job = start_job(
        "--nnodes", "2", "--node-ttl", "20", TOY, "--steps", "60", "--step-delay", "0.15"
    )
    wait_for(lambda: "step 5 " in job.log_text(), 60, "training to reach step 5")
    etcd = wait_for(lambda: _embedded_etcd(job), 10, "the embedded etcd")
    etcd.send_signal(signal.SIGSTOP)
    try:  # the outage itself: the thing under test
        time.sleep(run_mirror.PROBE_S + launcher.POLL_S + launcher.STORE_DEADLINE_S + 0.5)
    finally:
        etcd.send_signal(signal.SIGCONT)
    assert job.wait() == 0, job.output
    assert job.output.count("launcher: etcd unreachable") == 1, job.output
    assert job.output.count("launcher: etcd reachable again after") == 1, job.output
    ended = next(e for e in job.events() if "etcd was unreachable for" in e["message"])
    assert float(ended["message"].split("unreachable for ")[1].split(" s")[0]) >= 2.0
    assert job.status()["job"]["restarts_used"] == 0
