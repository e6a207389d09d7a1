"""The torture suite's jobs: start one, find its parts, end it, and measure what it cost.

A job trains examples/train_gpt.py (a small GPT, checkpoint engine on) on 3 nodes + 1 spare:
  LocalJob    `transom run` on one machine: the launcher's embedded etcd, 2 controller
              candidates, 4 node agents (what a user runs; the launcher owns etcd)
  ProxiedJob  the multi-machine mode's parts, started one by one: an etcd this harness owns,
              2 `transom controller` candidates and 4 `transom agent`s, each process reaching
              etcd through a `StoreProxy` of its own node (the controllers through one of their
              own), so one node can be cut off from etcd, or the whole store made slow.
(`transom run --store` per node would name every node's controller candidate alike on one
host, and candidate ids must be unique, so the proxied job starts agents and controllers itself.)

`measure` turns a finished job into one row: succeeded, restarts, evictions, steps lost (steps
trained twice because a generation restarted from an older checkpoint), weights bit-identical to
the fault-free reference (`reference_weights`: the same training under torchrun, no faults),
processes and /dev/shm entries of the job left behind after it ended, and wrong loads (a rank of
a generation that restored another step than the one its controller chose).

This module starts and stops only the processes of the jobs it starts; it never changes Transom.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil

from benchmarks import REPO
from transom.common import files, keys
from transom.store import EmbeddedEtcd, Store, StoreAccess, StoreError
from transom.testing.jobs import (
    SMALL_GPT,
    embedded_etcd,
    etcd_access,
    job_processes,
    transom_run,
    wait_for,
)
from transom.utils.procs import new_session_dying_with_parent

SCRIPT = REPO / "examples" / "train_gpt.py"
STEP_DELAY_S = 0.2
CKPT_EVERY = 3
NODES, SPARES = 3, 1
LEFTOVER_GRACE_S = 10.0
SHM = Path("/dev/shm")


def train_args(steps: int, seed: int, final: Path, ckpt_every: int = CKPT_EVERY) -> list[str]:
    return [
        str(SCRIPT), *SMALL_GPT, "--steps", str(steps), "--seed", str(seed),
        "--ckpt-every", str(ckpt_every), "--log-every", "1",
        "--step-delay", str(STEP_DELAY_S), "--save-final", str(final),
    ]  # fmt: skip


def reference_weights(work: Path, steps: int, seed: int, world: int = NODES) -> Path:
    """The final weights of the same training without faults (torchrun), made once per work dir."""
    out = work / f"reference-steps{steps}-seed{seed}-world{world}.pt"
    if out.exists():
        return out
    ref_dir = work / f"reference-{uuid.uuid4().hex[:6]}"
    ref_dir.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSOM_")}
    env["OMP_NUM_THREADS"] = "1"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc-per-node", str(world),
        *train_args(steps, seed, out, ckpt_every=0), "--ckpt-dir", str(ref_dir / "ckpt"),
    ]  # fmt: skip
    with open(ref_dir / "reference.log", "wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, cwd=ref_dir, env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = process.wait(timeout=600)
        finally:
            kill_session(process)
    if code != 0 or not out.exists():
        raise RuntimeError(f"the fault-free reference run failed; see {ref_dir / 'reference.log'}")
    return out


def kill_session(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


class Job:
    """What both kinds of job share: the run directory, reading etcd directly, finding processes."""

    def __init__(
        self, work: Path, steps: int, seed: int, options: list[str], ckpt_every: int = CKPT_EVERY
    ):
        self.job_id = "tt-" + uuid.uuid4().hex[:8]
        self.run_dir = work / self.job_id
        self.run_dir.mkdir(parents=True)
        self.final = self.run_dir / "final.pt"
        self.steps, self.seed = steps, seed
        self.options = ["--nnodes", str(NODES), "--spares", str(SPARES), *options]
        self.ckpt_every = ckpt_every
        self.script_args = train_args(steps, seed, self.final, ckpt_every)
        self._store: Store | None = None
        self.started = time.time()
        # What this harness read from etcd itself while the job ran: the job's events and its
        # newest job record survive a launcher that died before mirroring them.
        self.seen_events: dict[str, dict] = {}
        self.seen_record: dict = {}
        self._watching = threading.Event()
        self.kills = 0  # the kill scenarios: kills to make (torture.py --kills)
        self.moments: list[dict] = []  # and the kills made (time, victim, rank, node, step)

    # -- etcd, read by this harness directly ---------------------------------------------------
    def watch(self) -> None:
        """Keep reading the job's events and record from etcd (every second) until `unwatch`."""

        def run() -> None:
            while not self._watching.wait(1.0):
                events = self.read(keys.EVENTS, prefix=True)
                if isinstance(events, dict):
                    self.seen_events.update(events)
                record = self.read(keys.JOB)
                if isinstance(record, dict):
                    self.seen_record = record

        threading.Thread(target=run, daemon=True, name="torture-watch").start()

    def unwatch(self) -> None:
        self._watching.set()

    def access(self) -> StoreAccess | None:
        raise NotImplementedError

    def store(self) -> Store | None:
        if self._store is None:
            access = self.access()
            if access is not None:
                self._store = Store(access, self.job_id, timeout=2.0)
        return self._store

    def read(self, name: str, prefix: bool = False):
        """A value (or a prefix's values) from etcd now; None when etcd does not answer."""
        store = self.store()
        try:
            if store is None:
                return None
            return store.get_prefix(name) if prefix else store.get(name)
        except StoreError:
            self._store = None  # etcd may have come back elsewhere (a restarted etcd)
            return None

    def job_state(self) -> str | None:
        job = self.read(keys.JOB)
        return job.get("state") if isinstance(job, dict) else None

    # -- processes ------------------------------------------------------------------------------
    def processes(self) -> list[psutil.Process]:
        seen, out = set(), []
        for p in job_processes(self.job_id) + job_processes(str(self.run_dir)):
            if p.pid not in seen:
                seen.add(p.pid)
                out.append(p)
        return out

    def find(self, *words: str) -> psutil.Process | None:
        """The job's process whose command line holds every one of `words` (as arguments)."""
        for p in self.processes():
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if all(re.search(rf"(^| ){re.escape(w)}( |$)", cmd) for w in words):
                return p
        return None

    def agent(self, node: str) -> psutil.Process | None:
        return self.find("agent", "--node-id", node)

    def leader(self) -> psutil.Process | None:
        leader = self.read(keys.LEADER)
        return self.find("--candidate-id", leader) if isinstance(leader, str) else None

    def worker_pids(self, node: str | None = None) -> dict[int, int]:
        """rank -> pid of the current generation's workers (of `node`), as the agents report."""
        job = self.read(keys.JOB) or {}
        out = {}
        for name, status in (self.read(keys.STATUS, prefix=True) or {}).items():
            if node is not None and name != node:
                continue
            if status.get("generation") == job.get("generation"):
                out.update({int(r): int(pid) for r, pid in (status.get("pids") or {}).items()})
        return out

    def log_text(self, pattern: str) -> str:
        return "".join(
            p.read_text(errors="replace") for p in sorted((self.run_dir / files.LOGS).glob(pattern))
        )

    def reached(self, step: int) -> bool:
        return re.search(rf"^step {step} ", self.log_text("g*/rank0.log"), re.M) is not None

    def wait_for_step(self, step: int, timeout: float = 150) -> None:
        wait_for(lambda: self.reached(step) or self.ended(), timeout, f"step {step}")
        if not self.reached(step):
            raise RuntimeError(f"job {self.job_id} ended before step {step}")

    # -- the end --------------------------------------------------------------------------------
    def ended(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float) -> bool:
        """Wait for the job to end by itself; True if it did in time."""
        try:
            wait_for(self.ended, timeout, "the job to end", interval=0.5)
            return True
        except TimeoutError:
            return False

    def events(self) -> list[dict]:
        """The run directory's events and those this harness read from etcd, in time order."""
        path = self.run_dir / files.EVENTS
        mirrored = []
        if path.exists():
            mirrored = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        merged = {(e["time"], e["kind"], e.get("message")): e for e in mirrored}
        for e in self.seen_events.values():
            merged.setdefault((e["time"], e["kind"], e.get("message")), e)
        return sorted(merged.values(), key=lambda e: e["time"])

    def final_record(self) -> dict:
        """The newest job record: the run directory's last snapshot or what this harness read."""
        try:
            mirrored = json.loads((self.run_dir / files.STATUS).read_text()).get("job") or {}
        except (OSError, ValueError):
            mirrored = {}
        newest = max((mirrored, self.seen_record), key=lambda r: (r.get("updated") or 0, len(r)))
        return newest

    def leftovers(self) -> dict:
        """After the job ended by itself: its processes still alive after a grace period, and
        its /dev/shm entries (shared memory outlives processes)."""
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while time.monotonic() < deadline and (self.processes() or self.shm()):
            time.sleep(0.5)
        procs = []
        for p in self.processes():
            try:
                procs.append(" ".join(p.cmdline())[:160])
            except psutil.Error:
                continue
        return {"processes": procs, "shm": [str(p) for p in self.shm()]}

    def shm(self) -> list[Path]:
        return sorted(SHM.glob(f"*{self.job_id}*"))

    def cleanup(self) -> None:
        """Kill whatever of the job is left (after `leftovers` recorded it) and free its memory."""
        for p in self.processes():
            try:
                p.kill()
            except psutil.Error:
                pass
        for path in self.shm():
            shutil.rmtree(path, ignore_errors=True)


class LocalJob(Job):
    """`transom run` on one machine (the launcher's own etcd, 2 controllers, 4 agents)."""

    def start(self) -> LocalJob:
        self.out_path = self.run_dir.with_suffix(".out")
        self._out = open(self.out_path, "wb")
        argv = transom_run(self.run_dir, self.job_id, *self.options, *self.script_args)
        self.process = subprocess.Popen(
            argv, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def etcd(self) -> psutil.Process | None:
        return embedded_etcd(self.run_dir)

    def access(self) -> StoreAccess | None:
        etcd = self.etcd()
        return None if etcd is None else etcd_access(etcd, self.run_dir)

    def ended(self) -> bool:
        return self.process.poll() is not None

    def succeeded(self) -> bool:
        return self.process.poll() == 0

    def stop(self) -> None:
        """Stop the launcher if it still runs (Ctrl-C first, so it frees what it holds)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                kill_session(self.process)
        self._out.close()


class ProxiedJob(Job):
    """The multi-machine mode's parts on one machine, each node behind its own etcd proxy."""

    def start(self) -> ProxiedJob:
        from transom.testing.store_proxy import StoreProxy

        self.etcd_server = EmbeddedEtcd(
            self.run_dir.parent / f"etcd-{uuid.uuid4().hex[:6]}",
            log_path=files.log_file(self.run_dir, "etcd"),
        ).start()
        direct = self.etcd_server.access
        self.nodes = [f"node{i}" for i in range(NODES + SPARES)]
        self.proxies = {
            name: StoreProxy(direct.host, direct.port, name) for name in ["control", *self.nodes]
        }
        self.children: dict[str, subprocess.Popen] = {}
        base = [sys.executable, "-m", "transom", "--log-level", "info"]
        for i in range(2):
            name = f"controller-tt{i}"
            argv = [*base, "controller", *self._argv("control"), "--job-id", self.job_id]
            argv += ["--candidate-id", name]
            if i == 0:  # the first candidate writes the job spec
                argv += [*self.options, *self.script_args]
            self._spawn(name, argv)
        for node in self.nodes:
            argv = [*base, "agent", *self._argv(node), "--job-id", self.job_id]
            argv += ["--node-id", node, "--run-dir", str(self.run_dir), "--host", "127.0.0.1"]
            self._spawn(f"agent-{node}", argv)
        return self

    def _argv(self, proxy: str) -> list[str]:
        access = self.etcd_server.access
        proxied = StoreAccess(self.proxies[proxy].url, access.ca, access.cert, access.key)
        return proxied.argv()

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = files.log_file(self.run_dir, name)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.children[name] = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=new_session_dying_with_parent,
            )  # fmt: skip

    def access(self) -> StoreAccess | None:
        return self.etcd_server.access

    def ended(self) -> bool:
        state = self.job_state()
        if state in ("SUCCEEDED", "FAILED"):
            return True
        return all(p.poll() is not None for p in self.children.values())

    def succeeded(self) -> bool:
        return self.job_state() == "SUCCEEDED"

    def mirror(self) -> None:
        """What the launcher would have left in the run directory: events and status."""
        store = self.store()
        assert store is not None
        from transom.view import snapshot

        try:
            events = sorted(store.get_prefix(keys.EVENTS).values(), key=lambda e: e["time"])
            (self.run_dir / files.EVENTS).write_text("".join(json.dumps(e) + "\n" for e in events))
            (self.run_dir / files.STATUS).write_text(json.dumps(snapshot(store), indent=1))
        except StoreError:
            pass

    def leftovers(self) -> dict:
        # The agents and controllers end by themselves once the job ended (as under a launcher).
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self.children.values()):
            time.sleep(0.5)
        return super().leftovers()

    def stop(self) -> None:
        for proxy in self.proxies.values():
            proxy.set_pass()
        for process in self.children.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
        for process in self.children.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                kill_session(process)
        self.mirror()

    def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.close()
        self.etcd_server.stop()
        shutil.rmtree(self.etcd_server.data_dir, ignore_errors=True)
        shutil.rmtree(self.etcd_server.tls_dir, ignore_errors=True)
