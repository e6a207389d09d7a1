"""Timelines: shards of different jobs, generations or world sizes never form one checkpoint; a
replaced generation's saves are refused; poisoned steps leave every tier; no restore step in the
plan means a fresh start."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from conftest import wait_for

from transom import checkpoint
from transom.checkpoint import catalog, flatten, layout, shard_format, storage
from transom.checkpoint.publisher import PlanView
from transom.checkpoint.server import CheckpointServer
from transom.checkpoint.server_options import ServerConfig


def _shard(
    step: int, rank: int, tl: shard_format.Timeline, value: float = 0.0
) -> tuple[bytes, memoryview]:
    plan = flatten.plan_state({"w": torch.full((16,), value)}, step, rank, tl.world_size, tl)
    data = torch.zeros(plan.data_len, dtype=torch.uint8)
    flatten.copy_into(plan, data)
    view = memoryview(data.numpy())
    plan.header = plan.header.with_chunks(shard_format.checksum_data(view))
    return shard_format.encode_header(plan.header), view


def _write(
    root: Path, step: int, rank: int, tl: shard_format.Timeline, value: float = 0.0, keep: int = 3
) -> list[int]:
    head, data = _shard(step, rank, tl, value)
    storage.write_shard(root, step, rank, head, data, tl)
    return storage.complete_step(root, step, tl.world_size, keep=keep, timeline=tl)


def test_a_manifest_never_covers_shards_of_two_world_sizes(tmp_path: Path) -> None:
    one, two = shard_format.Timeline("j", 0, 1), shard_format.Timeline("j", 1, 2)
    _write(tmp_path, 7, 0, one)
    assert storage.complete_steps(tmp_path) == [7]
    _write(tmp_path, 7, 1, two)  # rank 1 of a world of 2: rank 0 on disk is a world of 1's
    assert storage.complete_steps(tmp_path) == []  # the old manifest is withdrawn
    assert storage.latest_step(tmp_path) is None
    _write(tmp_path, 7, 0, two)
    manifest = storage.read_manifest(tmp_path, 7)
    assert manifest is not None and manifest.timeline == two
    header, _ = storage.read_shard(storage.shard_path(tmp_path, 7, 1), 7, 1)
    assert header.timeline == two


@pytest.mark.parametrize(
    "value, expected",
    [
        ([], None),
        ("manifest", None),
        ({}, storage.Manifest(None, None)),
        ({"world_size": "2", "timeline": None}, storage.Manifest(None, None)),
        ({"world_size": 0}, storage.Manifest(None, None)),
        ({"world_size": True}, storage.Manifest(None, None)),
        ({"world_size": 2, "timeline": "j"}, storage.Manifest(2, None, bad_timeline=True)),
        (
            {"timeline": {"job": "j", "generation": -1, "world_size": 1}},
            storage.Manifest(None, None, True),
        ),
        (
            {"world_size": 1, "timeline": {"job": "j", "generation": 0, "world_size": 1}},
            storage.Manifest(1, shard_format.Timeline("j", 0, 1)),
        ),
    ],
)
def test_a_manifest_is_parsed_once_every_field_checked(value, expected) -> None:
    assert storage.Manifest.parse(value) == expected


def test_a_shard_under_a_manifest_with_a_malformed_timeline_is_refused(tmp_path: Path) -> None:
    tl = shard_format.Timeline("j", 0, 1)
    _write(tmp_path, 3, 0, tl)
    path, manifest = (
        storage.shard_path(tmp_path, 3, 0),
        storage.step_dir(tmp_path, 3) / "manifest.json",
    )
    manifest.write_text('{"world_size": 1, "timeline": {"job": "j"}}')
    assert storage.read_manifest(tmp_path, 3) == storage.Manifest(1, None, bad_timeline=True)
    with pytest.raises(shard_format.ShardError, match="names no valid timeline"):
        storage.read_shard(path, 3, 0)
    manifest.write_text("not json")  # a manifest this code cannot read checks nothing
    assert storage.read_manifest(tmp_path, 3) is None
    assert storage.read_shard(path, 3, 0)[0].timeline == tl
    manifest.write_text(
        '{"world_size": 1, "timeline": {"job": "k", "generation": 0, "world_size": 1}}'
    )
    with pytest.raises(shard_format.ShardError):  # another timeline's step
        storage.read_shard(path, 3, 0)


def test_a_re_saved_step_replaces_its_manifest_and_an_older_generation_is_refused(
    tmp_path: Path,
) -> None:
    old, new = shard_format.Timeline("j", 1, 2), shard_format.Timeline("j", 2, 2)
    for rank in (0, 1):
        _write(tmp_path, 5, rank, old, 1.0)
    assert storage.complete_steps(tmp_path) == [5]
    _write(tmp_path, 5, 0, new, 2.0)  # a rollback re-saves step 5: not complete until rank 1
    assert storage.complete_steps(tmp_path) == []
    _write(tmp_path, 5, 1, new, 2.0)
    assert storage.read_manifest(tmp_path, 5) == storage.Manifest(world_size=2, timeline=new)
    with pytest.raises(storage.StaleTimeline):  # a zombie of generation 1 persisting late
        _write(tmp_path, 5, 1, old, 1.0)
    for rank in (0, 1):
        _, data = storage.read_shard(storage.shard_path(tmp_path, 5, rank), 5, rank)
        assert float(layout.rebuild(_, data)["w"][0]) == 2.0


def test_an_older_generation_never_writes_over_a_newer_ones_shard_of_an_unfinished_step(
    tmp_path: Path,
) -> None:
    old, new = shard_format.Timeline("j", 1, 2), shard_format.Timeline("j", 2, 2)
    _write(tmp_path, 5, 0, new, 2.0)  # rank 1 not there yet: no manifest to compare with
    with pytest.raises(storage.StaleTimeline):
        _write(tmp_path, 5, 0, old, 1.0)
    header, _ = storage.read_shard(storage.shard_path(tmp_path, 5, 0), 5, 0)
    assert header.timeline == new
    _write(tmp_path, 6, 0, old, 1.0)
    _write(tmp_path, 6, 0, new, 2.0)  # the newer generation replaces the older one's file
    assert storage.read_header(storage.shard_path(tmp_path, 6, 0)).timeline == new


def test_a_shard_that_does_not_match_its_manifest_is_a_shard_error(tmp_path: Path) -> None:
    tl = shard_format.Timeline("j", 0, 1)
    _write(tmp_path, 3, 0, tl)
    other_head, other_data = _shard(3, 0, shard_format.Timeline("other-job", 0, 1))
    storage.atomic_write(storage.shard_path(tmp_path, 3, 0), [other_head, other_data])
    with pytest.raises(shard_format.ShardError, match="timeline"):
        storage.read_shard(storage.shard_path(tmp_path, 3, 0), 3, 0)


def test_discarded_steps_leave_storage_by_the_generation_that_wrote_them(tmp_path: Path) -> None:
    old, new = shard_format.Timeline("j", 1, 1), shard_format.Timeline("j", 2, 1)
    for step in (1, 2, 3):
        _write(tmp_path, step, 0, old, keep=9)
    _write(tmp_path, 4, 0, new, keep=9)  # the generation that discards: its own steps stay
    _write(tmp_path, 5, 0, shard_format.Timeline("other-job", 9, 1), keep=9)  # not j's at all
    future = time.time() + 3600  # a file's clock says nothing: only its timeline does
    for step in (3, 4):
        for f in storage.step_dir(tmp_path, step).iterdir():
            os.utime(f, (future, future))
    assert storage.discard_steps(tmp_path, 2, 2, "j") == [2, 3]
    assert storage.complete_steps(tmp_path) == [5, 4, 1] and storage.latest_step(tmp_path) == 5
    assert not storage.step_dir(tmp_path, 3).exists()
    assert storage.discard_steps(tmp_path, 2, 2, "j") == []


def test_a_discard_never_removes_another_jobs_steps_or_a_file_it_cannot_read(
    tmp_path: Path,
) -> None:
    """A rerun that resumes job A's step 10 starts fresh from there (its discard covers steps
    >= 11 of its own earlier generations): A's later steps, and a file naming no timeline,
    stay."""
    a = shard_format.Timeline("job-a", 3, 2)
    for step in (10, 20):
        for rank in (0, 1):
            _write(tmp_path, step, rank, a, keep=9)
    _write(tmp_path, 30, 0, a, keep=9)  # A's step 30 never completed
    (storage.step_dir(tmp_path, 30) / "rank_000001.shard").write_bytes(b"torn")
    assert storage.discard_steps(tmp_path, 11, 1, "job-b") == []
    assert storage.discard_steps(tmp_path, 0, 1, "job-b") == []  # a fresh start: first_bad 0
    assert storage.complete_steps(tmp_path) == [20, 10]
    assert storage.shard_ranks(tmp_path, 30) == {0, 1}


def test_retention_keeps_another_jobs_steps_until_this_job_has_k_newer_ones(
    tmp_path: Path,
) -> None:
    a, b = shard_format.Timeline("job-a", 1, 1), shard_format.Timeline("job-b", 1, 1)
    for step in (100, 110, 120):
        _write(tmp_path, step, 0, a, keep=2)
    assert storage.complete_steps(tmp_path) == [120, 110]
    # Job B started over beside them (--fresh): its steps are older numbers, and its own.
    for step in (10, 20, 30):
        _write(tmp_path, step, 0, b, keep=2)
    assert storage.complete_steps(tmp_path) == [120, 110, 30, 20]
    # Job B resumed from A's step 120: A's steps go once B has 2 newer complete ones.
    _write(tmp_path, 130, 0, b, keep=2)
    assert storage.complete_steps(tmp_path) == [130, 120, 110, 30]
    _write(tmp_path, 140, 0, b, keep=2)
    assert storage.complete_steps(tmp_path) == [140, 130]


def test_a_step_completes_beside_a_higher_ranks_file_another_world_left(tmp_path: Path) -> None:
    """Job A (2 ranks) left rank 1's shard of step 30, never completed; job B (1 rank) saves
    step 30: complete for B's world, A's file is not part of it."""
    _write(tmp_path, 30, 1, shard_format.Timeline("job-a", 1, 2))
    b = shard_format.Timeline("job-b", 1, 1)
    _write(tmp_path, 30, 0, b)
    manifest = storage.read_manifest(tmp_path, 30)
    assert manifest == storage.Manifest(world_size=1, timeline=b)
    assert storage.restorable_steps(tmp_path, 1) == [30]


def _server(tmp_path: Path, **kw) -> CheckpointServer:
    cfg = ServerConfig(
        node_id="n0",
        socket_path=Path("/dev/shm") / f"transom-test-tl-{os.getpid()}" / "s.sock",
        shm_dir=Path("/dev/shm") / f"transom-test-tl-{os.getpid()}",
        budget_bytes=1 << 30,
        replicas=0,
        storage_dir=tmp_path / "ckpt",
        **kw,
    )
    return CheckpointServer(cfg).start()


def test_a_server_refuses_saves_of_a_replaced_generation(tmp_path: Path, monkeypatch) -> None:
    server = _server(tmp_path)
    try:
        server.publisher.plan = PlanView(generation=3)
        monkeypatch.setenv("TRANSOM_GENERATION", "2")
        zombie = checkpoint.Engine(socket_path=str(server.cfg.socket_path), rank=0, world_size=1)
        h = zombie.save(10, {"w": torch.ones(4)})
        assert not h.ok and "older than the plan's generation 3" in str(h.error)
        zombie.close()
        monkeypatch.setenv("TRANSOM_GENERATION", "3")
        current = checkpoint.Engine(socket_path=str(server.cfg.socket_path), rank=0, world_size=1)
        h = current.save(10, {"w": torch.ones(4)})
        h.wait("storage", timeout=30)
        header, _ = storage.read_shard(storage.shard_path(tmp_path / "ckpt", 10, 0))
        assert header.timeline == shard_format.Timeline("local", 3, 1)
        current.close()
    finally:
        server.stop()


def test_discarded_steps_leave_memory_and_storage(tmp_path: Path) -> None:
    server = _server(tmp_path, memory_keep=3)
    try:
        engine = checkpoint.Engine(socket_path=str(server.cfg.socket_path), rank=0, world_size=1)
        for step in (1, 2, 3):
            engine.save(step, {"w": torch.full((4,), float(step))}).wait("storage", timeout=30)
        marks = [catalog.Discard(first_bad_step=2, generation=1)]  # saved by generation 0
        server.publisher.discards = marks  # as the publisher does when etcd pushes them
        server._discard(marks)
        assert {s.step for s in server.memory.shards.values()} == {1}
        assert storage.complete_steps(tmp_path / "ckpt") == [1]
        assert float(engine.load()["w"][0]) == 1.0  # the newest step left is the pre-NaN one
        engine.close()
    finally:
        server.stop()


def test_a_shard_discarded_while_in_use_goes_when_the_use_ends(tmp_path: Path) -> None:
    server = _server(tmp_path, memory_keep=3)
    try:
        engine = checkpoint.Engine(socket_path=str(server.cfg.socket_path), rank=0, world_size=1)
        for step in (1, 2):
            engine.save(step, {"w": torch.full((4,), float(step))}).wait("storage", timeout=30)
        read = server.memory.shards[(2, 0)]
        assert server.memory.pin(read)  # a peer or a restore reading step 2 right now
        marks = [catalog.Discard(first_bad_step=2, generation=1)]  # saved by generation 0
        server.publisher.discards = marks
        server._discard(marks)
        assert (2, 0) in server.memory.shards  # never pulled from under its reader
        server.memory.unpin(read)
        assert set(server.memory.shards) == {(1, 0)}
        # Staged before the discard, checksummed after it: never kept, listed or persisted.
        handle = engine.save(3, {"w": torch.full((4,), 3.0)})
        with pytest.raises(checkpoint.CheckpointError, match="not held by this server"):
            handle.wait("memory", timeout=30)
        assert set(server.memory.shards) == {(1, 0)}
        assert storage.complete_steps(tmp_path / "ckpt") == [1]
        engine.close()
    finally:
        server.stop()


def test_no_restore_step_in_the_plan_means_fresh(tmp_path: Path, monkeypatch) -> None:
    with checkpoint.Engine(storage_dir=tmp_path / "ckpt") as engine:
        engine.save(4, {"w": torch.ones(4)}).wait("storage", timeout=30)
    monkeypatch.setenv("TRANSOM_GENERATION", "2")  # under a launcher whose plan names no step
    monkeypatch.delenv("TRANSOM_RESTORE_STEP", raising=False)
    with checkpoint.Engine(storage_dir=tmp_path / "ckpt") as engine:
        assert engine.load() is None
        monkeypatch.setenv("TRANSOM_RESTORE_STEP", "4")
        assert float(engine.load()["w"][0]) == 1.0
    monkeypatch.delenv("TRANSOM_GENERATION")
    monkeypatch.delenv("TRANSOM_RESTORE_STEP")
    with checkpoint.Engine(storage_dir=tmp_path / "ckpt") as engine:  # no launcher: the newest
        assert float(engine.load()["w"][0]) == 1.0


@pytest.mark.slow
def test_discarded_steps_are_never_listed_again_even_after_a_new_lease(
    tmp_path: Path, monkeypatch
) -> None:
    from transom.checkpoint import catalog
    from transom.checkpoint.server_options import store_options
    from transom.store import EmbeddedEtcd, Store

    with EmbeddedEtcd(tmp_path / "etcd") as etcd:
        store = Store(etcd.access, "job")
        server = _server(tmp_path, memory_keep=3, job_id="job", **store_options(etcd.access))
        monkeypatch.setenv("TRANSOM_JOB_ID", "job")  # as a launcher sets it: shards of this job
        try:
            engine = checkpoint.Engine(
                socket_path=str(server.cfg.socket_path), rank=0, world_size=1
            )
            for step in (1, 2, 3):
                engine.save(step, {"w": torch.full((4,), float(step))}).wait("storage", timeout=30)
            wait_for(  # listed in the background, with the next batch of writes
                lambda: catalog.restorable_steps(store, 1) == [3, 2, 1], 10, "3 steps listed"
            )
            catalog.discard_poisoned(store, 2, 1)  # the engine saved as generation 0
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and storage.complete_steps(tmp_path / "ckpt") != [1]:
                time.sleep(0.1)
            assert storage.complete_steps(tmp_path / "ckpt") == [1]
            assert {s.step for s in server.memory.shards.values()} == {1}
            server.publisher._relist(store.lease(4))  # a lost lease replaced: all listed again
            writes = server.publisher.writes
            assert writes is not None
            wait_for(lambda: writes.pending == 0, 10, "the listings sent")
            assert sorted(catalog.shards(store)) == [1]  # steps 2 and 3 not listed again
            assert catalog.restorable_steps(store, 1) == [1]
            assert float(engine.load()["w"][0]) == 1.0
            engine.close()
        finally:
            server.stop()
