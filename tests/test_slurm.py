"""`transom run` on a real Slurm cluster: the allocation read right, a dead node replaced by the
spare (and drained), a job stopped by Slurm's signals resumed by the next one.

The slow tests start a private 4-node cluster on this machine (scripts/slurm_cluster.sh: its own
munged, slurmctld and one `slurmd -N nI` per node) for the module and stop it afterwards, even on
failure. They skip, saying why, where Slurm is not installed and cannot be (not root, no apt-get)
or its daemons cannot run here. Every job is `sbatch`ed with the script a user would write.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import job_processes, wait_for

from transom.checkpoint import storage
from transom.checkpoint.shm_dirs import default_shm_dir
from transom.cluster import slurm, slurm_run
from transom.common import files
from transom.common.records import JobRecord
from transom.common.states import JobState
from transom.control.candidacy import DEFAULT_CANDIDATES
from transom.control.tick import REASON_NOT_ENOUGH_NODES
from transom.workloads.results import read_results

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "slurm_cluster.sh"
SCRIPT = ROOT / "examples" / "train_gpt.py"
NODES = 4
EXIT_NOT_INSTALLABLE = 3  # slurm_cluster.sh: Slurm is missing and cannot be installed
# Long enough to stop it mid-run twice, short enough for a few minutes in all: a job's progress
# record lags its steps by up to a summary's interval (4 s, some 25 steps here), so a stop asked
# for at step 25 lands near step 50; the default model, so that a step's compute time is not
# mere scheduling noise (the straggler detector watches it).
STEPS = 120
TRAIN = ["--steps", str(STEPS), "--ckpt-every", "10", "--step-delay", "0.1", "--seed", "3"]
JOB_TIMEOUT_S = 240


# -- unit: what the allocation's environment says ---------------------------------------------


def _names(text: str) -> list[str]:
    return {"n[1-4]": ["n1", "n2", "n3", "n4"], "bad": ["n1", "../etc"]}.get(text, [])


def _environ(**changes: str) -> dict[str, str]:
    base = {
        "SLURM_JOB_ID": "42",
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": "1",
        "SLURMD_NODENAME": "n2",
        "SLURM_JOB_NODELIST": "n[1-4]",
        "SLURM_LOCALID": "0",
    }
    return {k: v for k, v in (base | changes).items() if v != "-"}


def test_an_allocation_names_the_job_the_nodes_and_the_first_node():
    a = slurm.detect(_environ(), _names)
    assert a is not None
    assert (a.job_id, a.node, a.first, a.is_first) == ("slurm-42.0", "n2", "n1", False)
    assert a.nodes == ("n1", "n2", "n3", "n4")
    requeued = slurm.detect(
        _environ(SLURM_RESTART_COUNT="2", SLURM_NODEID="0", SLURMD_NODENAME="n1"), _names
    )
    assert requeued is not None and requeued.job_id == "slurm-42.0-r2" and requeued.is_first


def test_outside_a_job_step_there_is_no_allocation():
    assert slurm.detect({}, _names) is None
    assert slurm.detect(_environ(SLURM_STEP_ID="-"), _names) is None  # the batch script itself


@pytest.mark.parametrize(
    "changes, complaint",
    [
        ({"SLURM_JOB_ID": "42; rm -rf /"}, "SLURM_JOB_ID"),
        ({"SLURM_NODEID": "x"}, "SLURM_NODEID"),
        ({"SLURM_NODEID": "7"}, "does not name this node"),
        ({"SLURMD_NODENAME": "n3"}, "does not name this node"),
        ({"SLURMD_NODENAME": "../n2"}, "SLURMD_NODENAME"),
        ({"SLURM_LOCALID": "1"}, "one per node"),
        ({"SLURM_RESTART_COUNT": "-1"}, "SLURM_RESTART_COUNT"),
        ({"SLURM_JOB_NODELIST": "bad", "SLURM_NODEID": "0", "SLURMD_NODENAME": "n1"}, "node name"),
    ],
)
def test_an_environment_that_is_not_what_srun_gives_is_refused(changes, complaint):
    with pytest.raises(slurm.SlurmError, match=complaint):
        slurm.detect(_environ(**changes), _names)


@pytest.mark.parametrize(
    "state, reason, stopped",
    [
        (JobState.FAILED, f"{REASON_NOT_ENOUGH_NODES}: 2 healthy, at least 3 needed", True),
        (JobState.FAILED, "restart budget spent: 3 restarts allowed", False),
        (JobState.SUCCEEDED, "all 3 nodes finished generation 2", False),
    ],
)
def test_only_a_job_that_ran_out_of_nodes_asks_for_a_requeue(tmp_path, state, reason, stopped):
    job = JobRecord(state, 2, ["n1", "n2"], time.time(), reason=reason)
    (tmp_path / files.STATUS).write_text(json.dumps({"job": job.to_dict()}))
    assert slurm_run.ran_out_of_nodes(tmp_path) is stopped
    (tmp_path / files.STATUS).write_text("{not json")
    assert slurm_run.ran_out_of_nodes(tmp_path) is False


# -- the cluster -------------------------------------------------------------------------------


class Cluster:
    """The private cluster of scripts/slurm_cluster.sh, and what a test asks of it."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSOM_", "SLURM_"))}
        self.env |= {
            "SLURM_CONF": str(directory / "slurm.conf"),
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
        }

    def script(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(CLUSTER), *argv, str(self.dir), str(NODES)],
            capture_output=True,
            text=True,
            timeout=600,
            env=self.env,
        )

    def slurm(self, *argv: str) -> str:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=self.env)
        assert done.returncode == 0, f"{argv}: {done.stderr}"
        return done.stdout

    def submit(self, tmp: Path, name: str, options: list[str]) -> Job:
        """sbatch the job a user would write: 3 active nodes + 1 spare, one task per node."""
        job = Job(self, tmp, name)
        command = [
            sys.executable, "-m", "transom", "run", "--run-dir", str(job.run_dir),
            "--ckpt-storage", str(tmp / "checkpoints"),
            "--nnodes", "3", "--spares", "1", "--nproc-per-node", "1", *options,
            str(SCRIPT), *TRAIN, "--save-final", str(job.final), "--result-dir", str(job.results),
        ]  # fmt: skip
        batch = tmp / f"{name}.sbatch"
        batch.write_text(
            "#!/bin/bash\n"
            f"#SBATCH --nodes={NODES} --ntasks-per-node=1 --no-kill --output={job.output}\n"
            f"srun --no-kill --kill-on-bad-exit=0 {shlex.join(command)}\n"
            'echo "srun exit $?"\n'
        )
        job.id = self.slurm("sbatch", "--parsable", str(batch)).strip().split(";")[0]
        return job


class Job:
    def __init__(self, cluster: Cluster, tmp: Path, name: str):
        self.cluster, self.id = cluster, ""
        self.run_dir, self.final = tmp / name, tmp / f"{name}.pt"
        self.results, self.output = tmp / f"{name}-results", tmp / f"{name}.out"

    @property
    def job_id(self) -> str:
        return f"{slurm.JOB_PREFIX}{self.id}.0"

    def progress(self) -> dict:
        """The newest progress record any node's launcher wrote ({} before the first)."""
        for path in sorted((self.run_dir / self.job_id).glob("*/progress.jsonl")):
            lines = path.read_text().splitlines()
            if lines:
                return json.loads(lines[-1])
        return {}

    def wait_step(self, step: int) -> dict:
        return wait_for(
            lambda: (p := self.progress()).get("step") and p["step"] >= step and p,
            JOB_TIMEOUT_S,
            f"job {self.id} to reach step {step}",
            interval=0.5,
        )

    def wait_end(self, dead: str = "") -> str:
        wait_for(
            lambda: not self.cluster.slurm("squeue", "-h", "-j", self.id).strip(),
            JOB_TIMEOUT_S,
            f"job {self.id} to end",
            interval=1.0,
        )
        # Nothing of the job outlives it.
        wait_for(lambda: not job_processes(self.job_id), 30, "the job's processes to exit")
        shm = {default_shm_dir(self.job_id, f"n{i}") for i in range(1, NODES + 1)}
        shm.discard(
            default_shm_dir(self.job_id, dead)
        )  # gone with a real machine; the test removes it
        assert not [d for d in shm if d.exists()], "checkpoint memory outlived the job"
        return self.output.read_text() if self.output.exists() else ""

    def resumed_step(self) -> int:
        results = read_results(self.results)
        assert results, f"job {self.id} wrote no results"
        steps = {r["resumed_step"] for r in results.values()}
        assert len(steps) == 1, f"ranks resumed from different steps {steps}"
        return steps.pop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("bash") is None:
        pytest.skip("no bash to run scripts/slurm_cluster.sh")
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    started = c.script("start")
    try:
        if started.returncode == EXIT_NOT_INSTALLABLE:
            pytest.skip(f"Slurm is not installed and cannot be: {started.stderr.strip()}")
        if started.returncode != 0:
            logs = "\n".join(p.read_text()[-600:] for p in (c.dir / "log").glob("*.log"))
            pytest.skip(f"Slurm's daemons cannot run here: {started.stderr.strip()}\n{logs}")
        yield c
    finally:
        stopped = c.script("stop")
        assert stopped.returncode == 0, stopped.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The final weights of the same training without faults: plain torchrun, 3 ranks."""
    tmp = tmp_path_factory.mktemp("reference")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSOM_", "SLURM_"))}
    env["OMP_NUM_THREADS"] = "1"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         str(SCRIPT), *TRAIN, "--ckpt-every", "0", "--ckpt-dir", str(tmp / "ckpt"),
         "--save-final", str(tmp / "final.pt")],
        check=True, env=env, timeout=300, capture_output=True,
    )  # fmt: skip
    return torch.load(tmp / "final.pt")


def _identical(path: Path, expected: dict) -> bool:
    got = torch.load(path)
    return list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in got)


def kill_node(cluster: Cluster, node: str) -> list[int]:
    """What a dead machine looks like to Slurm and to the job: SIGKILL for the node's slurmd and
    for every step daemon of that node with everything under it."""
    victims = [psutil.Process(int((cluster.dir / f"slurmd-{node}.pid").read_text()))]
    for p in psutil.process_iter(["name"]):
        try:
            if not (p.info["name"] or "").startswith("slurmstepd"):
                continue
            tree = p.children(recursive=True)
            if any(c.environ().get("SLURMD_NODENAME") == node for c in tree):
                victims += [p, *tree]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for v in victims:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass
    return [v.pid for v in victims]


# -- slow: real jobs on the cluster ------------------------------------------------------------


@pytest.mark.slow
def test_a_dead_node_is_replaced_by_the_spare_drained_and_the_weights_are_identical(
    cluster, reference, tmp_path
):
    job = cluster.submit(tmp_path, "kill", ["--slurm-drain"])
    victim = ""
    try:
        progress = job.wait_step(15)
        first = cluster.slurm("scontrol", "show", "hostnames", "n[1-4]").split()[0]
        victim = [m for m in progress["members"] if m != first][-1]  # the first node hosts etcd
        assert kill_node(cluster, victim)
        output = job.wait_end(dead=victim)
        status = json.loads((job.run_dir / job.job_id / first / "status.json").read_text())
        assert status["job"]["state"] == JobState.SUCCEEDED.value, output
        events = [
            json.loads(line)
            for line in (job.run_dir / job.job_id / first / "events.jsonl").read_text().splitlines()
        ]
        assert any(e["kind"] == "evict" and e.get("node") == victim for e in events), output
        assert any(e["kind"] == "spare" for e in events), output
        # Controller candidates on the first nodes only, and one launcher mirroring the job:
        # not a standby and a watch of every key on each of a thousand nodes.
        nodes = cluster.slurm("scontrol", "show", "hostnames", "n[1-4]").split()
        attempt = job.run_dir / job.job_id
        candidates = [n for n in nodes if list((attempt / n / files.LOGS).glob("controller-*"))]
        # (the first to register; the next node is promoted when a dead one's lease expires,
        # which the job, ending as soon as the dead node is evicted, may not outlive)
        one_died = victim in candidates  # then one more may have been promoted
        assert DEFAULT_CANDIDATES <= len(candidates) <= DEFAULT_CANDIDATES + one_died, candidates
        assert [n for n in nodes if (attempt / n / files.STATUS).exists()] == [first]
        assert _identical(job.final, reference), "final weights differ from the fault-free run"
        state, reason = (
            cluster.slurm("sinfo", "-h", "-N", "-n", victim, "-o", "%T|%E").strip().split("|", 1)
        )
        assert state.startswith("drain") and reason.startswith("transom: node lost"), (
            state,
            reason,
        )
    finally:
        if job.id:
            subprocess.run(["scancel", job.id], env=cluster.env, capture_output=True)
        if victim:  # the dead node's memory stayed behind, as a real machine's would not
            shutil.rmtree(default_shm_dir(job.job_id, victim), ignore_errors=True)
        assert cluster.script("start").returncode == 0  # the dead node serves again


@pytest.mark.slow
def test_a_job_stopped_by_the_time_limit_or_scancel_resumes_in_the_next_one(
    cluster, reference, tmp_path
):
    """USR1 (what --signal=USR1@T sends every process of the step), then SIGTERM (scancel):
    each job stops with its newest checkpoint in storage and the next job resumes there; the
    last one finishes with the weights of a run that was never stopped."""
    checkpoints = tmp_path / "checkpoints"
    jobs = []
    try:
        first = cluster.submit(tmp_path, "first", [])
        jobs.append(first)
        first.wait_step(25)
        cluster.slurm("scancel", "--signal=USR1", first.id)
        output = first.wait_end()
        assert "srun exit 75" in output, output
        assert "requeue or re-submit" in output, output
        after_first = storage.complete_steps(checkpoints)
        assert after_first and after_first[0] >= 20, after_first

        second = cluster.submit(tmp_path, "second", [])
        jobs.append(second)
        second.wait_step(after_first[0] + 15)
        assert second.resumed_step() == after_first[0]
        cluster.slurm("scancel", second.id)
        second.wait_end()
        after_second = storage.complete_steps(checkpoints)
        assert after_second[0] >= after_first[0] + 10, (after_first, after_second)

        third = cluster.submit(tmp_path, "third", [])
        jobs.append(third)
        output = third.wait_end()
        assert "srun exit 0" in output, output
        assert third.resumed_step() == after_second[0]
        assert _identical(third.final, reference), "final weights differ from an unstopped run"
    finally:
        for job in jobs:
            subprocess.run(["scancel", job.id], env=cluster.env, capture_output=True)
