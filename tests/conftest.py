"""Shared fixtures: run `transom` as a real subprocess; prove that nothing of a job outlives it.

The test tiers (unit, integration, e2e) are given by the pytest plugin transom.testing.tier_plugin,
which pyproject.toml loads for every test directory (docs/testing.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from transom.common import env
from transom.faults.mock_nvml import MockNvml
from transom.monitor.node import NodeMonitor
from transom.store import EmbeddedEtcd, Store, StoreError

# Waiting with a deadline, finding a job's processes, the smallest example GPT: one definition,
# shared with the benchmarks (the tests import them from here).
from transom.testing.jobs import (  # noqa: F401
    SMALL_GPT,
    agent_process,
    embedded_etcd,
    etcd_access,
    etcd_requests_by_method,
    job_processes,
    wait_for,
)
from transom.utils.net import free_port

REPO = Path(__file__).resolve().parent.parent

TOY = REPO / "tests" / "scripts" / "ddp_toy.py"


def skip_unless_installed(package: str) -> None:
    """Skip the calling test module when `package` is not installed: found, not imported (for
    lightning an import costs every pytest process that collects the module 3 s of CPU; the
    tests' own processes import it)."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed", allow_module_level=True)


def shm_dir_for(tmp_path: Path, suffix: str = "") -> Path:
    """A /dev/shm folder for a test's checkpoint server, unique to the test and to the pytest
    process (tmp_path's name alone repeats across pytest-xdist's workers)."""
    return Path("/dev/shm") / f"transom-test-{os.getpid()}-{tmp_path.name}{suffix}"


def held_shard(step: int, rank: int) -> SimpleNamespace:
    """What a checkpoint server's publisher reads of a shard its memory holds."""
    return SimpleNamespace(
        step=step,
        rank=rank,
        world_size=2,
        header=None,
        region=SimpleNamespace(nbytes=8),
        generation=1,
        origin="",
    )


def raw_shard_header(fields: dict) -> bytes:
    """The bytes in front of a shard's data for a header of any JSON `fields`, valid or not
    (`shard_format.encode_header` writes only a `ShardHeader`): to forge shards with."""
    import xxhash

    from transom.checkpoint import shard_format

    body = json.dumps(fields, separators=(",", ":")).encode()
    data_len = fields.get("data_len")
    prefix = shard_format.PREFIX.pack(
        shard_format.MAGIC,
        shard_format.FORMAT_VERSION,
        len(body),
        xxhash.xxh3_64_intdigest(body),
        data_len if type(data_len) is int and 0 <= data_len < 1 << 64 else 0,
    )
    out = prefix + body
    return out + bytes(shard_format.header_span(len(body)) - len(out))


@contextmanager
def standalone_ckpt_server(tmp_path: Path, name: str, memory: str) -> Iterator[tuple]:
    """A checkpoint server process of its own (no etcd, no peer; storage in tmp_path/storage)
    and an Engine of rank 0 of 1 on it: (process, engine, storage directory). Both are stopped
    and the server's shared memory removed on exit, whatever the test did."""
    from transom import checkpoint
    from transom.checkpoint import server_options

    shm_dir = Path("/dev/shm") / f"transom-test-{name}-{os.getpid()}"
    storage_dir = tmp_path / "storage"
    p = subprocess.Popen(
        [
            *(sys.executable, "-m", "transom.checkpoint.server"),
            *("--node-id", "n1", "--shm-dir", str(shm_dir), "--memory", memory),
            *("--storage", str(storage_dir), "--replicas", "0"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
    )
    engine = None
    try:
        assert p.stdout is not None
        assert p.stdout.readline().startswith("ready")
        socket_path = shm_dir / server_options.SOCKET_NAME
        engine = checkpoint.Engine(socket_path=str(socket_path), rank=0, world_size=1)
        yield p, engine, storage_dir
    finally:
        if engine is not None:
            engine.close(wait=False)
        if p.poll() is None:
            p.kill()
            p.wait()
        shutil.rmtree(shm_dir, ignore_errors=True)


@contextmanager
def monitored_ranks(
    tmp_path: Path,
    program: Path,
    args: list[str],
    extra: dict[str, str] | None = None,
    world: int = 2,
    **kw,
) -> Iterator[tuple[NodeMonitor, list[subprocess.Popen]]]:
    """A real node agent's monitor (NodeMonitor) and `world` ranks of `program` started
    through the worker bootstrap (the cold-start path), reporting to it, with the torchrun
    environment of one node; every process is ended on exit (continued first, in case a test
    stopped it). `kw` goes to NodeMonitor (hang_floor_s, script)."""
    stacks_dir = tmp_path / "logs"
    stacks_dir.mkdir()
    monitor = NodeMonitor("nodeA", nvml=MockNvml(), scope=str(tmp_path), **kw)
    monitor.expect_ranks(list(range(world)), stacks_dir)
    port = free_port("127.0.0.1")
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world):
            worker_env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": "0",
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RESTART_COUNT": "0",
                "OMP_NUM_THREADS": "1",
                env.GENERATION: "0",
                env.MONITOR_SOCKET: str(monitor.socket_path),
                env.STACKS_DIR: str(stacks_dir),
                "PYTHONPATH": str(REPO),
                "HF_HUB_OFFLINE": "1",
                **(extra or {}),
            }
            log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-u", "-m", "transom.control.bootstrap", str(program), *args],
                    env=worker_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=tmp_path,
                )
            )
            log.close()
        yield monitor, procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()
        monitor.close()


def rank_logs(tmp_path: Path, world: int = 2) -> str:
    """The output of `monitored_ranks`' ranks."""
    return "".join((tmp_path / f"rank{r}.log").read_text(errors="replace") for r in range(world))


def ranks_finished(procs: list[subprocess.Popen], tmp_path: Path, timeout: float = 90) -> None:
    """Wait for `monitored_ranks`' ranks to end; each must have exited 0."""
    wait_for(lambda: all(p.poll() is not None for p in procs), timeout, "the ranks to finish")
    assert [p.returncode for p in procs] == [0] * len(procs), rank_logs(tmp_path, len(procs))


def torch_mapped(pid: int) -> list[str]:
    """The files of torch's package that process `pid` has mapped: its native libraries are, from
    the moment anything in the process imports torch (a checkpoint server never should)."""
    with open(f"/proc/{pid}/maps") as maps:
        files = {fields[-1] for line in maps if len(fields := line.split()) >= 6}
    return sorted(f for f in files if "torch" in Path(f).parts)


@contextmanager
def running_etcd(data_dir: Path, **options) -> Iterator[EmbeddedEtcd]:
    """A real embedded etcd, stopped on exit even if a test left it SIGSTOPped."""
    server = EmbeddedEtcd(data_dir, **options)
    try:
        server.start()
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """A real embedded etcd shared by one test module (a module that stops or restarts etcd
    has its own, from `running_etcd`)."""
    with running_etcd(tmp_path_factory.mktemp("etcd") / "etcd") as server:
        yield server


@pytest.fixture
def store(etcd):
    """A Store for a job of its own, so tests sharing the server do not see each other's keys."""
    s = Store(etcd.access, f"test-{uuid.uuid4().hex[:8]}")
    yield s
    try:
        s.delete_job()
    except StoreError:
        pass


def etcd_requests(store: Store) -> float:
    """How many requests etcd has received so far (its gRPC messages, from its metrics)."""
    return sum(etcd_requests_by_method(store).values())


class Job:
    """One `transom run` (or `transom demo`) subprocess with its own run directory and job id."""

    def __init__(
        self,
        run_dir: Path,
        args: list[str],
        env: dict | None = None,
        job_id: str | None = None,
        command: str = "run",
    ):
        self.run_dir = run_dir
        self.job_id = job_id or "t-" + uuid.uuid4().hex[:8]
        self.argv = [
            sys.executable,
            "-m",
            "transom",
            command,
            "--run-dir",
            str(run_dir),
            "--job-id",
            self.job_id,
            *args,
        ]
        self.out_path = run_dir.parent / f"{run_dir.name}.out"
        self._out = open(self.out_path, "wb")
        self.process = subprocess.Popen(
            self.argv,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self._out.flush()

    @property
    def output(self) -> str:
        self._out.flush()
        return self.out_path.read_text(errors="replace")

    def status(self) -> dict:
        try:
            return json.loads((self.run_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def worker(self, rank: int) -> psutil.Process | None:
        """The live worker process of `rank` in the current generation, as its agent reports it.

        (A worker in a warm interpreter keeps the agent's environment in /proc, so the agents'
        pid reports, not environments, say which process is which rank.)"""
        snapshot = self.status()
        generation = snapshot.get("job", {}).get("generation")
        for status in snapshot.get("statuses", {}).values():
            pid = (status.get("pids") or {}).get(str(rank))
            if pid is None or status.get("generation") != generation:
                continue
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    return p
            except psutil.NoSuchProcess:
                pass
        return None

    def log_text(self, pattern: str = "g*/rank*.log") -> str:
        return "".join(
            p.read_text(errors="replace") for p in sorted(self.run_dir.glob(f"logs/{pattern}"))
        )

    def story(self, tail: int = 3000) -> str:
        """What the job did, for a failed test's report: its events but the per-rank checkpoint
        chatter, then the tail of its output."""
        lines = [
            f"{e.get('kind')}: {e.get('message', '')}"
            for e in self.events()
            if e.get("kind") != "checkpoint" or e.get("action") == "restored"
        ]
        return "\n".join([f"--- job {self.job_id} ({self.run_dir})", *lines, self.output[-tail:]])

    def kill(self) -> None:
        """End the launcher's whole session, then anything left of the job."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        for p in job_processes(self.job_id) + job_processes(str(self.run_dir)):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self._out.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, so a fixture can tell that its test failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def start_job(tmp_path, request):
    """start_job(args...) -> Job; every job is ended after the test, and must leave no process.

    When the test fails, each job's story (events, output tail) is printed into its report."""
    jobs: list[Job] = []

    def start(
        *args: str,
        env: dict | None = None,
        job_id: str | None = None,
        command: str = "run",
        run_dir: Path | None = None,
    ) -> Job:
        run_dir = run_dir or tmp_path / f"run{len(jobs)}"
        job = Job(run_dir, [str(a) for a in args], env, job_id, command)
        jobs.append(job)
        return job

    yield start
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for job in jobs:
            print(job.story())
    leftovers = []
    for job in jobs:
        if job.process.poll() is None:
            job.kill()
            continue
        # The job ended by itself: nothing of it may remain (allow a moment for reaping).
        try:
            wait_for(
                lambda job=job: not (job_processes(job.job_id) + job_processes(str(job.run_dir))),
                10,
                "the job's processes to exit",
            )
        except TimeoutError:
            leftovers += [" ".join(p.cmdline()) for p in job_processes(job.job_id)]
        job.kill()
    assert not leftovers, f"processes outlived their job: {leftovers}"
