"""Checkpoint shared memory on one machine: unique names per job, owners, sweeps of dead processes
only, capacity from the real limits (a small /dev/shm refuses saves, never kills), and an
in-process engine's cleanup at exit (normal or SIGKILL)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import standalone_ckpt_server

from transom.checkpoint import capacity, layout, shm_dirs
from transom.checkpoint.shm import MappingCache, RegionDir

ROOT = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_two_jobs_with_a_long_common_prefix_get_distinct_folders_and_sockets() -> None:
    a = shm_dirs.default_shm_dir("pretrain-llama3-8b-2026-11-30-run-01", "node-000001")
    b = shm_dirs.default_shm_dir("pretrain-llama3-8b-2026-11-30-run-02", "node-000001")
    c = shm_dirs.default_shm_dir("pretrain-llama3-8b-2026-11-30-run-01", "node-000002")
    assert len({a, b, c}) == 3
    assert a == shm_dirs.default_shm_dir("pretrain-llama3-8b-2026-11-30-run-01", "node-000001")
    assert len(str(a / shm_dirs.SOCKET_NAME)) < 100  # fits a Unix socket address
    # Ids that differ only after the readable part, or in characters a path cannot hold.
    assert shm_dirs.default_shm_dir("x" * 200 + "1", "n") != shm_dirs.default_shm_dir(
        "x" * 200 + "2", "n"
    )
    assert "/" not in shm_dirs.default_shm_dir("a/b", "../n").name


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path, as /dev/shm's are: the sweep probes a socket inside each
    folder, and under a long tmp_path (pytest-xdist's) its address would not fit a Unix socket's,
    which the sweep must count as "cannot tell" and keep."""
    folder = Path(tempfile.mkdtemp(prefix="tsh-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.integration
def test_a_live_jobs_folder_is_never_taken_or_swept(short_dir: Path, monkeypatch) -> None:
    tmp_path = short_dir
    monkeypatch.setattr(shm_dirs, "CLAIM_WAIT_S", 0.5)  # how long a claim waits for its owner
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other = tmp_path / "transom-run-02-node-abc"
        other.mkdir()
        (other / "r000001-64").write_bytes(b"x" * 64)
        owner = {"pid": live.pid, "start": shm_dirs._start_time(live.pid), "job": "run-02"}
        (other / shm_dirs.OWNER_FILE).write_text(__import__("json").dumps(owner))
        with pytest.raises(shm_dirs.OwnedBySomeoneElse, match="running process"):
            RegionDir(other, "run-01", "node")
        assert shm_dirs.sweep_stale_shm(tmp_path) == []
        assert (other / "r000001-64").exists()
    finally:
        live.kill()
        live.wait()
    # Its owner is gone: the next sweep frees it, and the folder can be claimed again.
    assert shm_dirs.sweep_stale_shm(tmp_path) == [other]
    assert not other.exists()


@pytest.mark.integration
def test_sweep_removes_dead_owners_folders_and_keeps_foreign_ones(tmp_path: Path) -> None:
    dead = tmp_path / "transom-dead-n-0123"
    RegionDir(dead, "job", "n")
    owner = shm_dirs.read_owner(dead)
    assert owner is not None and owner.pid == os.getpid()
    mine = tmp_path / "transom-mine-n-4567"
    RegionDir(mine, "job", "n")
    (dead / shm_dirs.OWNER_FILE).write_text(
        __import__("json").dumps({"pid": _dead_pid(), "start": 1.0})
    )
    reused = tmp_path / "transom-reused-n-89ab"  # a pid now used by another (younger) process
    RegionDir(reused, "job", "n")
    (reused / shm_dirs.OWNER_FILE).write_text(
        __import__("json").dumps({"pid": os.getpid(), "start": 12345.0})
    )
    foreign = tmp_path / "transom-something-else"  # no owner, no socket: not a server's
    foreign.mkdir()
    assert shm_dirs.sweep_stale_shm(tmp_path) == [dead, reused]
    assert mine.exists() and foreign.exists()


def test_an_owner_file_that_is_not_a_valid_record_names_no_owner(tmp_path: Path) -> None:
    directory = tmp_path / "transom-bad-n-0"
    directory.mkdir()
    for bad in (
        '{"pid": "1"}',
        '{"start": 1.0}',
        '{"pid": 1, "start": "x"}',
        "[1]",
        "{",
        "[" * 99999,
    ):
        (directory / shm_dirs.OWNER_FILE).write_text(bad)
        assert shm_dirs.read_owner(directory) is None
    (directory / shm_dirs.OWNER_FILE).write_text('{"pid": 1, "job": "j", "future": true}')
    assert shm_dirs.read_owner(directory) == shm_dirs.Owner(1, None, "j")


def test_capacity_is_the_smallest_real_limit(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    limit = capacity.effective_budget(1 << 62, tmp_path / "regions")
    assert limit.nbytes <= free and limit.source != "the configured checkpoint memory budget"
    assert capacity.effective_budget(4096, tmp_path).nbytes == 4096
    # cgroup v2: the tightest memory.max along the path; "max" is no limit.
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    (root / "memory.max").write_text("max\n")
    (root / "a" / "memory.max").write_text("1000\n")
    (root / "a" / "b" / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert capacity.cgroup_memory_limit(root, proc) == 1000
    proc.write_text("4:memory:/x\n")  # v1; the huge "unlimited" number is no limit
    (root / "memory").mkdir()
    (root / "memory" / "memory.limit_in_bytes").write_text(str(capacity.V1_UNLIMITED))
    assert capacity.cgroup_memory_limit(root, proc) is None
    (root / "memory" / "memory.limit_in_bytes").write_text("2000\n")
    assert capacity.cgroup_memory_limit(root, proc) == 2000


SMALL_SHM_SCRIPT = """
import os, shutil, sys, torch
from transom import checkpoint
from transom.checkpoint.shm import RegionDir
# 1. A 256 MiB state against a 64 MiB /dev/shm: refused with the reason, training goes on.
ckpt = checkpoint.Engine(storage_dir=sys.argv[1], memory_bytes=1 << 40)
state = {"w": torch.ones(64 << 20)}  # 256 MiB
for step in range(3):
    state["w"] += 1  # training goes on
    h = ckpt.save(step, state)
    assert not h.ok, "a 256 MiB save fitted a 64 MiB /dev/shm"
    assert "free space of /dev/shm" in h.error, h.error
    print("refused:", h.error.splitlines()[0])
small = {"w": torch.ones(1 << 20)}  # 4 MiB fits
h = ckpt.save(10, small)
assert h.ok, h.error
h.wait("storage")
# 2. /dev/shm fills up after the budget was set: the region cannot be allocated -> refused.
with open("/dev/shm/filler", "wb") as f:
    f.write(b"x" * (shutil.disk_usage("/dev/shm").free - (2 << 20)))
h = ckpt.save(11, {"w": torch.ones(4 << 20)})  # 16 MiB, within the budget, not within tmpfs
assert not h.ok and "cannot" in h.error, h.error
print("refused:", h.error.splitlines()[0])
ckpt.close()
assert float(checkpoint.Engine(storage_dir=sys.argv[1]).load(10)["w"][0]) == 1.0
print("TRAINING WENT ON")
"""


def _can_unshare() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"no private mount namespace here (unshare -m: {probe.stderr.strip()[:100]})"
    return None


@pytest.mark.integration
def test_a_small_dev_shm_refuses_saves_with_a_reason_and_training_goes_on(tmp_path: Path) -> None:
    why = _can_unshare()
    if why:
        pytest.skip(why)
    script = tmp_path / "small_shm.py"
    script.write_text(SMALL_SHM_SCRIPT)
    shell = (
        "mount -t tmpfs -o size=64m tmpfs /dev/shm && "
        f"exec {sys.executable} {script} {tmp_path / 'ckpt'}"
    )
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]  # no SIGBUS (-7), no exception
    assert done.stdout.count("refused:") == 4 and "TRAINING WENT ON" in done.stdout, out[-3000:]


EXIT_SCRIPT = """
import os, sys, time, torch
from transom import checkpoint
ckpt = checkpoint.Engine(storage_dir=sys.argv[1], memory_bytes=64 << 20)
h = ckpt.save(1, {"w": torch.ones(1 << 18)})
h.wait("memory")
print("SAVED", ckpt.server.cfg.shm_dir, flush=True)
if sys.argv[2] == "hang":
    time.sleep(600)
sys.stdin.readline()  # alive until the test has looked at its folder
# normal exit without close(): the finalizer frees the regions
"""


@pytest.mark.integration
def test_single_process_engines_leave_nothing_in_dev_shm(tmp_path: Path) -> None:
    """RUNS runs (half exit normally without close(), half are SIGKILLed after a save), then a
    new engine: nothing of theirs is left in /dev/shm."""
    runs = 6
    script = tmp_path / "run.py"
    script.write_text(EXIT_SCRIPT)
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    left: list[Path] = []
    for i in range(runs):
        mode = "exit" if i % 2 == 0 else "hang"
        p = subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "ckpt"), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=environ,
        )
        try:
            assert p.stdout is not None and p.stdin is not None
            line = p.stdout.readline()
            assert line.startswith("SAVED"), line
            folder = Path(line.split()[1])
            assert any(folder.iterdir())  # it held regions while alive
            if mode == "hang":
                p.send_signal(signal.SIGKILL)
            p.stdin.close()  # an "exit" run exits now
            assert p.wait(60) in (0, -signal.SIGKILL)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        if mode == "exit":
            assert not folder.exists(), "a normal exit left its regions in /dev/shm"
        left.append(folder)
    from transom import checkpoint

    with checkpoint.Engine(storage_dir=tmp_path / "ckpt2", memory_bytes=16 << 20):
        remaining = [f for f in left if f.exists()]
        assert remaining == []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(f.exists() for f in left):
        time.sleep(0.1)
    assert not any(f.exists() for f in left)


@pytest.mark.integration
def test_server_sigterm_frees_shared_memory_and_exits_0(tmp_path: Path) -> None:
    shm_dir = Path("/dev/shm") / f"transom-test-sigterm-{os.getpid()}"
    p = subprocess.Popen(
        [
            *(sys.executable, "-m", "transom.checkpoint.server"),
            *("--node-id", "n1", "--shm-dir", str(shm_dir), "--memory", "64M"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline().startswith("ready")
        assert shm_dirs.read_owner(shm_dir).pid == p.pid
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        assert not shm_dir.exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.mark.integration
def test_server_sigterm_persists_what_its_workers_saved_before_it_exits(tmp_path: Path) -> None:
    """The time limit's signal or scancel stops a node right after a save: the step that was
    only in memory must still reach storage (within config.PERSIST_ON_STOP_S)."""
    import torch

    from transom.checkpoint import storage

    with standalone_ckpt_server(tmp_path, "persist", "256M") as (p, engine, storage_dir):
        state = {"w": torch.randn(24 << 20)}  # 96 MiB: persisting it takes a while
        assert engine.save(5, state).ok  # in memory; persistence runs in the background
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        assert storage.complete_steps(storage_dir) == [5]


def test_a_save_never_goes_into_a_mapping_of_a_deleted_region_reborn_under_its_path(
    tmp_path: Path,
) -> None:
    # A worker kept mapping r...-N while its server died and a new server created a region under
    # the same path: writes through the old mapping went into the deleted file, the new server
    # checksummed and persisted its zeros (the torture suite's kill_mixed found it).
    path = tmp_path / "region"
    path.write_bytes(b"\x01" * 4096)
    cache = MappingCache(layout.as_bytes)
    cache.get(str(path), 4096)[:] = 1
    path.unlink()
    path.write_bytes(b"\x00" * 4096)  # the new server's region, same path, another file
    cache.get(str(path), 4096)[:] = 7
    assert path.read_bytes() == b"\x07" * 4096
    path.unlink()
    path.write_bytes(b"\x00" * 4096)
    assert cache.drop_missing() == [str(path)]  # the engine's check before a save finds it too
    cache.clear()


def test_region_names_carry_the_server_process_so_a_new_server_never_reuses_one(
    tmp_path: Path,
) -> None:
    regions = RegionDir(tmp_path / "regions")
    names = {regions.new(64).path.name for _ in range(3)}
    assert len(names) == 3 and all(n.startswith(f"r{os.getpid()}-") for n in names)


def test_every_mapping_is_released_once_before_it_is_closed(tmp_path: Path) -> None:
    # The engine unregisters a pinned region in `release`; a mapping closed without it kept the
    # region's pages pinned after the server deleted it (the GPU path's leak).
    released: list[int] = []
    cache = MappingCache(layout.as_bytes, limit=2, release=lambda v: released.append(v.data_ptr()))
    paths = [tmp_path / f"r{i}" for i in range(4)]
    for p in paths:
        p.write_bytes(b"\x00" * 4096)
    views = {p.name: cache.get(str(p), 4096).data_ptr() for p in paths[:3]}  # r0 over the limit
    assert released == [views["r0"]]
    paths[1].unlink()
    assert cache.drop_missing() == [str(paths[1])]  # a region the server deleted
    assert released == [views["r0"], views["r1"]]
    cache.get(str(paths[2]), 4096)  # still mapped: no release
    cache.clear()
    assert released == [views["r0"], views["r1"], views["r2"]]


def test_the_next_saves_region_is_mapped_before_that_save(tmp_path: Path) -> None:
    """A worker maps the region of its next save in the background after each save, so that
    save is a plain copy: the region the server hands it next is mapped already."""
    import torch
    from conftest import wait_for

    from transom import checkpoint
    from transom.checkpoint import reshard
    from transom.checkpoint.worker_protocol import Abort, Region, Reserve

    state = {"w": torch.randn(1 << 18)}
    nbytes = reshard.plan_state(state, 0, 0, 1).data_len
    with checkpoint.Engine(storage_dir=tmp_path, rank=0, world_size=1) as engine:
        engine.save(1, state).wait("memory", timeout=30)
        for step in (2, 3, 4, 5):  # new regions until memory's two steps and a spare rotate
            wait_for(lambda: not engine._next._busy.locked(), 10, "the next region mapped")
            mapped = set(engine._maps._maps)
            probe = Reserve(100 + step, 0, nbytes, world_size=1)
            reply = engine.connection.request(probe)  # what the next save is handed
            engine.connection.request(Abort(100 + step, 0))
            assert isinstance(reply, Region) and reply.path in mapped, (step, reply, mapped)
            engine.save(step, state).wait("memory", timeout=30)


@pytest.mark.parametrize("persist", [False, True])
def test_prepare_makes_every_region_the_first_saves_rotate_through(
    tmp_path: Path, persist: bool
) -> None:
    """`Engine.prepare` populates a region for each save of the rotation (the steps memory keeps
    of such saves, at least two of memory-only ones, and the save in progress), so no first save
    waits for a region being made (the 3rd save of 1 GiB waited 2 s here)."""
    import torch

    from transom import checkpoint
    from transom.checkpoint import reshard
    from transom.checkpoint.server_options import DEFAULT_MEMORY_KEEP
    from transom.checkpoint.worker_protocol import Status, StatusRequest

    rotation = (DEFAULT_MEMORY_KEEP if persist else max(DEFAULT_MEMORY_KEEP, 2)) + 1
    state = {"w": torch.randn(1 << 16)}
    nbytes = reshard.plan_state(state, 0, 0, 1).data_len
    with checkpoint.Engine(storage_dir=tmp_path, rank=0, world_size=1) as engine:
        assert engine.prepare(state, persist=persist)
        status = engine.connection.request(StatusRequest())
        assert isinstance(status, Status)
        assert status.free == [nbytes] * rotation and status.used == rotation * nbytes
        for step in range(1, rotation + 3):
            handle = engine.save(step, state, persist=persist)
            handle.wait("storage" if persist else "memory", timeout=30)
        status = engine.connection.request(StatusRequest())
        assert isinstance(status, Status)
        assert status.used == rotation * nbytes  # no region made beyond those prepared
