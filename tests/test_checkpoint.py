"""Tests of the checkpoint engine in one process: shard format, engine with its embedded server,
budget, retention, storage, corruption, authentication and pickle-free loading."""

from __future__ import annotations

import json
import pickle
import struct
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import raw_shard_header, shm_dir_for, wait_for

from transom import checkpoint
from transom.checkpoint import (
    flatten,
    layout,
    replication,
    server_options,
    shard_format,
    storage,
    tiers,
)
from transom.checkpoint.load_record import LoadRecord
from transom.checkpoint.server import CheckpointServer
from transom.checkpoint.server_options import ServerConfig, parse_size
from transom.checkpoint.tiers import LoaderContext, LoadTier
from transom.checkpoint.worker_protocol import Source

ALL_DTYPES = sorted(layout.DTYPES.values(), key=str)


def random_tensor(dtype: torch.dtype, shape=(6, 5)) -> torch.Tensor:
    """Random bits reinterpreted as `dtype`: every bit pattern (NaN payloads too) must survive."""
    size = dtype.itemsize
    raw = torch.randint(0, 256, (int(np.prod(shape)) * size,), dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw % 2).bool().view(shape)
    return raw.view(dtype).view(shape)


def same(a, b) -> bool:
    """Bitwise equality of two states (dtype, shape, strides, bytes; plain values by ==)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or (a.dtype, a.shape, a.stride()) != (
            b.dtype,
            b.shape,
            b.stride(),
        ):
            return False
        if a.numel() == 0:
            return True
        return (
            bool(
                torch.equal(
                    a.contiguous().reshape(-1).view(torch.uint8),
                    b.contiguous().reshape(-1).view(torch.uint8),
                )
            )
            if a.dtype != torch.bool
            else bool(torch.equal(a, b))
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def rich_state() -> dict:
    torch.manual_seed(1)
    base = torch.randn(8, 12)
    model = OrderedDict((("w", torch.randn(4, 4)), ("b", torch.zeros(4))))
    model._metadata = OrderedDict({"": {"version": 2}})  # type: ignore[attr-defined]
    return {
        "dtypes": {str(dt): random_tensor(dt) for dt in ALL_DTYPES},
        "base": base,
        "rows": base[2:5],
        "every_other_col": base[:, ::2],
        "transposed": base.t(),
        "expanded": torch.randn(3, 1).expand(3, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 7),
        "empty_bf16": torch.empty(2, 0, dtype=torch.bfloat16),
        "model": model,
        "param": torch.nn.Parameter(torch.randn(3)),
        "optim": {
            "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(4)}},
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "foreach": None, "params": [0]}],
        },
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.RandomState(3).get_state()},
        "plain": [
            1,
            -(2**80),
            2.5,
            float("inf"),
            float("nan"),
            1e-310,
            True,
            None,
            "ü text",
            b"\x00\xff",
            3 + 4j,
            torch.float16,
            torch.device("cpu"),
            torch.Size([2, 3]),
            ("nested", [{"deep": (1,)}]),
        ],
        7: "int key",
        (1, 2): "tuple key",
    }


def test_every_dtype_and_layout_round_trips_bit_exactly(tmp_path: Path) -> None:
    state = rich_state()
    checkpoint.save(state, tmp_path / "s.ckpt")
    back = checkpoint.load(tmp_path / "s.ckpt")
    assert same(state, back)
    assert torch.bfloat16 in ALL_DTYPES and torch.float8_e4m3fn in ALL_DTYPES
    # Views of one storage come back as views of one storage, with their strides.
    ptr = back["base"].untyped_storage().data_ptr()
    for name in ("rows", "every_other_col", "transposed"):
        assert back[name].untyped_storage().data_ptr() == ptr, name
    back["base"][3, 0] = 42.0
    assert back["rows"][1, 0] == 42.0 and back["transposed"][0, 3] == 42.0
    assert back["model"]._metadata == {"": {"version": 2}}
    assert isinstance(back["param"], torch.nn.Parameter)


def test_unsupported_values_are_refused_clearly(tmp_path: Path) -> None:
    class Custom:
        pass

    with pytest.raises(checkpoint.UnsupportedValue, match="Custom"):
        checkpoint.save({"x": Custom()}, tmp_path / "x")
    with pytest.raises(checkpoint.UnsupportedValue, match="sparse"):
        checkpoint.save({"x": torch.eye(3).to_sparse()}, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def _shard_bytes(tmp_path: Path) -> bytes:
    checkpoint.save({"w": torch.arange(100, dtype=torch.float32)}, tmp_path / "ok")
    return (tmp_path / "ok").read_bytes()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[: len(b) - 10], "truncated"),
        (lambda b: b[:20], "truncated"),
        (lambda b: b"NOTSHARD" + b[8:], "bad magic"),
        (lambda b: b[:-5] + bytes([b[-5] ^ 1]) + b[-4:], "checksum mismatch in data"),
        (lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:], "header checksum"),
        (lambda b: b[:8] + struct.pack("<I", 99) + b[12:], "version 99"),
    ],
)
def test_damaged_shards_are_rejected(tmp_path: Path, damage, message) -> None:
    (tmp_path / "bad").write_bytes(damage(_shard_bytes(tmp_path)))
    with pytest.raises(checkpoint.ShardError, match=message):
        checkpoint.load(tmp_path / "bad")


def _craft(header: dict, data: bytes) -> bytes:
    import xxhash

    header = {
        **header,
        "data_len": len(data),
        "chunks": [xxhash.xxh3_64_hexdigest(data)] if data else [],
    }
    return raw_shard_header(header) + data


@pytest.mark.parametrize(
    "tree, tensors, storages, message",
    [
        (
            {"T": 0},
            [{"dtype": "float32", "shape": [1000], "stride": [1], "byte": 0, "storage": 0}],
            [{"offset": 0, "nbytes": 64}],
            "outside its storage",
        ),
        ({"T": 0}, [], [], "not in its table"),
        ({"__reduce__": ["os.system", ["touch pwned"]]}, [], [], "unknown node type"),
        (
            {"T": 0},
            [{"dtype": "object", "shape": [1], "stride": [1], "byte": 0, "storage": 0}],
            [{"offset": 0, "nbytes": 64}],
            "malformed",
        ),
        (
            {
                "d": [
                    [
                        {"y": "gASVIAAAAAAAAACMAm9zlIwGc3lzdGVtlJOUjAh0b3VjaCBwd26UhZRSlC4="},
                        {"i": "1"},
                    ]
                ]
            },
            [],
            [],
            None,
        ),
    ],
)
def test_crafted_shards_cannot_run_code(
    tmp_path: Path, monkeypatch, tree, tensors, storages, message
) -> None:
    """Loading never unpickles: with pickle and torch.load disabled, a crafted shard is data or
    an error."""

    def forbidden(*a, **k):
        raise AssertionError("unpickling was attempted")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    header = {
        "format": shard_format.FORMAT_VERSION,
        "step": 0,
        "rank": 0,
        "world_size": 1,
        "tree": tree,
        "tensors": tensors,
        "storages": storages,
    }
    (tmp_path / "crafted").write_bytes(_craft(header, bytes(64)))
    if message is None:  # bytes that happen to be a pickle stay bytes
        back = checkpoint.load(tmp_path / "crafted")
        assert isinstance(next(iter(back)), bytes)
    else:
        with pytest.raises(checkpoint.ShardError, match=message):
            checkpoint.load(tmp_path / "crafted")
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


def test_engine_saves_to_memory_and_loads_back_bit_exactly(tmp_path: Path) -> None:
    state = rich_state()
    with checkpoint.Engine(storage_dir=tmp_path / "store") as engine:
        handle = engine.save(10, state)
        assert handle.ok
        handle.wait("memory", timeout=30)
        back = engine.load()
        assert engine.last_load.tier == "memory" and engine.last_load.step == 10
        assert same(state, back)
        back["base"].add_(1)  # a loaded tensor is the caller's: changing it changes no checkpoint
        assert same(state, engine.load(10))
        handle.wait("storage", timeout=30)
        with pytest.raises(checkpoint.CheckpointError, match="replication is off"):
            handle.wait("peer", timeout=30)
    # A new process (here: a new engine) finds it in storage.
    with checkpoint.Engine(storage_dir=tmp_path / "store") as engine:
        assert same(state, engine.load())
        assert engine.last_load.tier == "storage"


def test_corrupt_memory_copy_is_skipped_for_storage(tmp_path: Path) -> None:
    with checkpoint.Engine(storage_dir=tmp_path / "store") as engine:
        state = {"w": torch.randn(1000)}
        engine.save(3, state).wait("storage", timeout=30)
        shard = engine.server.memory.shards[(3, 0)]
        shard.region.map[100] ^= 0xFF  # a bit flip in the server's memory
        back = engine.load()
        assert engine.last_load.tier == "storage"
        assert same(state, back)
        # The engine's bad-copy report (a BadCopy, corrupt) made the server evict that copy.
        assert (3, 0) not in engine.server.memory.shards


def test_corrupt_storage_copy_is_detected_and_an_older_step_used(
    tmp_path: Path, monkeypatch
) -> None:
    root = tmp_path / "store"
    with checkpoint.Engine(storage_dir=root) as engine:
        for step in (1, 2):
            engine.save(step, {"w": torch.full((1000,), float(step))}).wait("storage", timeout=30)
    path = storage.shard_path(root, 2, 0)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01
    path.write_bytes(bytes(raw))
    with checkpoint.Engine(storage_dir=root) as engine:
        back = engine.load()  # no restore step given: the newest step that loads
        assert engine.last_load == LoadRecord(1, "storage", engine.last_load.seconds)
        assert torch.equal(back["w"], torch.full((1000,), 1.0))
        with pytest.raises(checkpoint.CheckpointError, match="checksum mismatch"):
            engine.load(step=2)  # the step the caller names, or an error: no fallback
        # The controller chose step 2 (the catalog still listed it): the ranks (here one) go on
        # to the newest older step they all hold, after reporting the bad copy.
        monkeypatch.setenv("TRANSOM_RESTORE_STEP", "2")
        assert torch.equal(engine.load()["w"], torch.full((1000,), 1.0))
        assert engine.last_load.step == 1


def _server(tmp_path: Path, budget: int, **kw) -> CheckpointServer:
    cfg = ServerConfig(
        node_id="n0",
        socket_path=tmp_path / "s.sock",
        shm_dir=tmp_path / "shm-unused",
        budget_bytes=budget,
        replicas=0,
        **kw,
    )
    cfg.shm_dir = shm_dir_for(tmp_path)
    return CheckpointServer(cfg).start()


def test_budget_refuses_a_save_that_does_not_fit_and_training_goes_on(tmp_path: Path) -> None:
    shard = 4 << 20
    server = _server(tmp_path, budget=2 * shard + (1 << 20), memory_keep=1)
    try:
        engine = checkpoint.Engine(socket_path=str(tmp_path / "s.sock"), rank=0, world_size=1)
        state = {"w": torch.zeros(shard // 4)}
        for step in (
            1,
            2,
            3,
            4,
        ):  # two regions fit: the newest complete step plus the one being saved
            engine.save(step, state).wait("memory", timeout=30)
        held = {s.step for s in server.memory.shards.values()}
        assert held == {4} and len(server.memory.free) == 1  # step 3's region waits for step 5
        big = engine.save(5, {"w": torch.zeros(3 * shard // 4)})
        assert not big.ok and "does not fit" in big.error and "--ckpt-memory" in big.error
        with pytest.raises(checkpoint.SaveRefused):
            big.wait("memory")
        assert {s.step for s in server.memory.shards.values()} == {4}  # nothing was lost
        assert engine.save(6, state).ok  # and the next save of the usual size works
        engine.close()
    finally:
        server.stop()


@pytest.mark.parametrize("keep", [1, ServerConfig.memory_keep])
def test_memory_keeps_the_newest_steps_and_one_region_per_rank_and_storage_keeps_k(
    tmp_path: Path, keep: int
) -> None:
    root = tmp_path / "store"
    server = _server(tmp_path, budget=1 << 30, storage_dir=root, storage_keep=2, memory_keep=keep)
    try:
        engine = checkpoint.Engine(
            socket_path=str(tmp_path / "s.sock"), rank=0, world_size=1, storage_dir=root
        )
        for step in range(1, 6):
            engine.save(step, {"w": torch.full((1 << 16,), float(step))}).wait(
                "storage", timeout=30
            )
        assert sorted(s.step for s in server.memory.shards.values()) == list(range(6 - keep, 6))
        region = server.memory.shards[(5, 0)].region.nbytes
        assert server.memory.used <= (keep + 1) * region  # the steps kept, and the next save's
        assert storage.complete_steps(root) == [5, 4]
        assert (root / "latest").read_text().strip() == "5"
        assert len(server.memory.free) >= 1  # an evicted step's region waits for the next save
        engine.close()
    finally:
        server.stop()


def test_memory_keeps_a_new_generation_s_steps_over_the_higher_ones_it_abandoned(
    tmp_path: Path,
) -> None:
    # A generation that starts again from an earlier step (a fresh start, a rollback) saves
    # lower step numbers than the history it abandoned: its saves are the newest, and memory
    # must keep them (it kept the highest step numbers, and evicted each new save at once).
    server = _server(tmp_path, budget=1 << 30, memory_keep=2)
    try:
        engine = checkpoint.Engine(socket_path=str(tmp_path / "s.sock"), rank=0, world_size=1)
        for generation, steps in ((3, (25, 26)), (4, (1, 2, 3))):
            engine.generation = generation
            for step in steps:
                engine.save(step, {"w": torch.full((1000,), float(step))}).wait("memory", 30)
        assert sorted(s.step for s in server.memory.shards.values()) == [2, 3]
        # A save older than what memory keeps (a late worker of generation 3) is evicted as it
        # completes, and never reported as held.
        engine.generation = 3
        late = engine.save(27, {"w": torch.full((1000,), 27.0)})
        with pytest.raises(checkpoint.CheckpointError, match="did not reach memory"):
            late.wait("memory", 30)
        assert sorted(s.step for s in server.memory.shards.values()) == [2, 3]
        engine.close()
    finally:
        server.stop()


def test_unwritable_storage_is_retried_and_reported(tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the storage directory should be")
    server = _server(tmp_path, budget=1 << 30, storage_dir=blocker / "ckpt")
    events = []
    monkeypatch.setattr(
        server.publisher, "event", lambda action, message, **f: events.append((action, message))
    )
    try:
        engine = checkpoint.Engine(socket_path=str(tmp_path / "s.sock"), rank=0, world_size=1)
        handle = engine.save(1, {"w": torch.ones(10)})
        handle.wait("memory", timeout=30)  # training goes on: the save is in memory
        wait_for(
            lambda: any(a == "failed" and "retrying" in m for a, m in events), 10, "a failure event"
        )
        blocker.unlink()  # the disk is fixed: the retry succeeds
        handle.wait("storage", timeout=30)
        assert storage.complete_steps(blocker / "ckpt") == [1]
        engine.close()
    finally:
        server.stop()


def test_peer_authentication(tmp_path: Path, monkeypatch) -> None:
    cfg = ServerConfig(
        node_id="n0",
        socket_path=tmp_path / "s.sock",
        shm_dir=shm_dir_for(tmp_path),
        budget_bytes=1 << 30,
        replicas=1,
        secret=b"the job's secret",
    )
    server = CheckpointServer(cfg).start()
    events = []
    monkeypatch.setattr(
        server.publisher, "event", lambda action, message, **f: events.append(action)
    )
    try:
        engine = checkpoint.Engine(socket_path=str(tmp_path / "s.sock"), rank=0, world_size=1)
        state = {"w": torch.randn(1000)}
        engine.save(1, state).wait("memory", timeout=30)
        with pytest.raises(replication.ReplicationError, match="authentication"):
            replication.fetch(server.addr, b"a guess", 1, 0)
        wait_for(lambda: "auth" in events, 10, "the server to report the rejected peer")
        header, data = replication.fetch(server.addr, b"the job's secret", 1, 0)
        assert same(state, layout.rebuild(header, data))
        engine.close()
    finally:
        server.stop()


def test_sizes_parse() -> None:
    assert (
        parse_size("8G") == 8 << 30
        and parse_size("512MiB") == 512 << 20
        and parse_size("1000") == 1000
    )
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_manifest_written_last(tmp_path: Path) -> None:
    """A step is complete only when every rank's shard is there; the manifest then lists them
    all."""
    root = tmp_path / "store"
    for rank in (0, 1):
        plan = flatten.plan_state({"r": torch.tensor([rank])}, 4, rank, 2)
        data = bytearray(plan.data_len)
        flatten.copy_into(plan, torch.frombuffer(data, dtype=torch.uint8))
        plan.header = plan.header.with_chunks(shard_format.checksum_data(memoryview(data)))
        header_bytes = shard_format.encode_header(plan.header)
        storage.write_shard(root, 4, rank, header_bytes, memoryview(data))
        storage.complete_step(root, 4, 2, keep=3)
        assert storage.complete_steps(root) == ([] if rank == 0 else [4])
    manifest = json.loads((storage.step_dir(root, 4) / "manifest.json").read_text())
    assert sorted(manifest["shards"]) == ["0", "1"] and manifest["world_size"] == 2


def test_shared_memory_of_dead_servers_is_swept_and_live_ones_kept(tmp_path: Path) -> None:
    import os
    import socket

    from transom.checkpoint.shm_dirs import STALE_SOCKET_AGE_S, sweep_stale_shm

    old = os.path.getmtime(tmp_path) - STALE_SOCKET_AGE_S - 10
    dirs = {name: tmp_path / f"transom-job-{name}" for name in ("dead", "live", "young")}
    listeners = []
    for name, d in dirs.items():
        d.mkdir()
        (d / "r000001-64").write_bytes(b"x" * 64)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(d / "server.sock"))
        if name == "live":
            s.listen()
            listeners.append(s)
        else:
            s.close()  # the server died: its socket file stays, nobody accepts
        if name != "young":
            os.utime(d / "server.sock", (old, old))
    try:
        assert sweep_stale_shm(tmp_path) == [dirs["dead"]]
        assert not dirs["dead"].exists()
        assert (dirs["live"] / "r000001-64").exists()  # its server still answers
        assert (dirs["young"] / "r000001-64").exists()  # may be a server still starting
    finally:
        for s in listeners:
            s.close()


class ObjectStoreTier(LoadTier):
    """A test-only tier: shards kept as encoded bytes in a dict, as an object store keeps them."""

    name = "object-store"

    def __init__(self) -> None:
        self.objects: dict[tuple[int, int], tuple[bytes, bytes]] = {}
        self.reads = 0

    def put(self, step: int, rank: int, world_size: int, state: dict) -> None:
        plan = flatten.plan_state(state, step, rank, world_size)
        data = bytearray(plan.data_len)
        flatten.copy_into(plan, torch.frombuffer(data, dtype=torch.uint8))
        plan.header = plan.header.with_chunks(shard_format.checksum_data(memoryview(data)))
        self.objects[(step, rank)] = (shard_format.encode_header(plan.header), bytes(data))

    def locate(self, ctx: LoaderContext, step: int, rank: int) -> list[Source]:
        return [Source(self.name, path=f"{step}/{rank}")] if (step, rank) in self.objects else []

    def read(self, ctx: LoaderContext, source: Source, step: int, rank: int):
        self.reads += 1
        head, data = self.objects[(step, rank)]
        header, _ = shard_format.decode_header(head)
        shard_format.check_identity(header, step, rank)
        buf = bytearray(data)
        shard_format.verify_data(header, memoryview(buf))
        return header, torch.frombuffer(buf, dtype=torch.uint8)

    def steps(self, ctx: LoaderContext, world_size: int) -> list[int]:
        return sorted({step for step, _ in self.objects}, reverse=True)


def test_a_registered_tier_is_consulted_after_the_built_in_ones(
    tmp_path: Path, monkeypatch
) -> None:
    extra = ObjectStoreTier()
    monkeypatch.setattr(tiers, "REGISTERED", [*tiers.REGISTERED, extra])
    only_there = {"w": torch.arange(10.0)}
    extra.put(7, 0, 1, only_there)
    with checkpoint.Engine(storage_dir=tmp_path / "store") as engine:
        assert same(only_there, engine.load(7))
        assert engine.last_load.tier == "object-store" and extra.reads == 1
        in_memory = {"w": torch.ones(10)}
        engine.save(3, in_memory).wait("memory", timeout=30)
        extra.put(3, 0, 1, {"w": torch.zeros(10)})
        assert same(in_memory, engine.load(3))  # a faster tier holds it: the new one is not read
        assert engine.last_load.tier == "memory" and extra.reads == 1
        assert same({"w": torch.zeros(10)}, engine.load(3, tier="object-store"))
        extra.objects[(7, 0)] = (extra.objects[(7, 0)][0], bytes(40))  # a corrupt copy
        with pytest.raises(checkpoint.CheckpointError, match="object-store: .*checksum"):
            engine.load(7)


def test_old_tier_names_still_work_with_a_deprecation_warning(tmp_path: Path) -> None:
    with checkpoint.Engine(storage_dir=tmp_path / "store") as engine:
        handle = engine.save(1, {"w": torch.ones(4)})
        with pytest.warns(DeprecationWarning, match="'persisted' is now called 'storage'"):
            handle.wait("persisted", timeout=30)
        with (
            pytest.warns(DeprecationWarning),
            pytest.raises(checkpoint.CheckpointError, match="off"),
        ):
            handle.wait("replicated", timeout=30)
        with pytest.raises(ValueError, match="unknown tier 'disk'"):
            handle.wait("disk")


def test_server_options_are_generated_from_its_config() -> None:
    parser = server_options.build_parser()
    argv = server_options.to_argv(
        node_id="n1", job_id="j", storage_keep=5, budget_bytes=1 << 30, storage_dir="/tmp/s"
    )
    assert argv[:4] == ["--node-id", "n1", "--job-id", "j"] and "--keep" in argv
    cfg = server_options.from_args(parser.parse_args(argv), environ={})
    assert (cfg.node_id, cfg.job_id, cfg.storage_keep, cfg.budget_bytes) == ("n1", "j", 5, 1 << 30)
    assert cfg.storage_dir == Path("/tmp/s") and cfg.socket_path == cfg.shm_dir / "server.sock"
    assert cfg.replicas == 0 and cfg.memory_keep == ServerConfig.memory_keep  # no peers: no replica
    with pytest.raises(KeyError, match="secret"):
        server_options.to_argv(secret=b"x")  # the secret is never an option (it would show in `ps`)
    networked = parser.parse_args(["--store", "http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="TRANSOM_CKPT_SECRET"):
        server_options.from_args(networked, environ={})
    cfg = server_options.from_args(networked, environ={"TRANSOM_CKPT_SECRET": "s"})
    assert cfg.secret == b"s" and cfg.replicas == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--memory", "lots"])


def test_the_plan_is_read_validated() -> None:
    from transom.checkpoint.publisher import PlanView, plan_view

    good = {
        "generation": 3,
        "members": ["n0", "n1"],
        "job_state": "RUNNING",
        "restore_step": 20,
        "other": 1,  # a newer writer's field
    }
    assert plan_view(good) == PlanView(3, ["n0", "n1"], 20)
    for field, wrong in (("generation", "3"), ("members", ["n0", 5]), ("restore_step", True)):
        bad = {**good, field: wrong}  # a plan that does not parse is no plan
        assert plan_view(bad) == PlanView()
    assert plan_view(None) == PlanView()
    assert plan_view(["n0"]) == PlanView()


def test_a_tensor_described_before_is_described_anew_once_it_views_other_memory() -> None:
    # plan_state remembers each tensor's description (a save every step sees the same tensors);
    # a tensor given new data, a new shape or requires_grad must not keep the old one.
    t = torch.nn.Parameter(torch.arange(4.0))
    first = flatten.plan_state({"t": t}, 1, 0, 1)
    assert first.header.tensors[0]["shape"] == [4] and first.header.tensors[0]["param"]
    assert flatten.plan_state({"t": t}, 2, 0, 1).header.tensors == first.header.tensors
    t.data = torch.arange(12.0).view(3, 4).t()  # other memory, shape and strides
    plan = flatten.plan_state({"t": t}, 3, 0, 1)
    entry = plan.header.tensors[0]
    assert entry["shape"] == [4, 3] and entry["stride"] == [1, 4] and plan.data_len >= 48
    t.requires_grad_(False)
    assert "grad" not in flatten.plan_state({"t": t}, 4, 0, 1).header.tensors[0]
    data = torch.zeros(plan.data_len, dtype=torch.uint8)
    flatten.copy_into(plan, data)
    assert torch.equal(layout.rebuild(plan.header, data)["t"], t.detach())


def test_the_bytes_a_repeated_save_copies_are_the_tensor_s_bytes_now() -> None:
    # A save every step reuses the byte view of each tensor's span it made before; the copy must
    # still be of the tensor's current bytes, of its new memory once it has other data, and of
    # the span of every tensor the state holds of one storage.
    t = torch.arange(4.0)
    for step, state in enumerate(({"t": t}, {"t": t}, {"t": t, "half": t[2:]}), start=1):
        t.add_(1.0)  # changed in place between saves
        plan = flatten.plan_state(state, step, 0, 1)
        data = torch.zeros(plan.data_len, dtype=torch.uint8)
        flatten.copy_into(plan, data)
        rebuilt = layout.rebuild(plan.header, data)
        assert all(torch.equal(rebuilt[k], v) for k, v in state.items())
    t.data = torch.arange(8.0) * 2
    plan = flatten.plan_state({"t": t}, 4, 0, 1)
    data = torch.zeros(plan.data_len, dtype=torch.uint8)
    flatten.copy_into(plan, data)
    assert torch.equal(layout.rebuild(plan.header, data)["t"], torch.arange(8.0) * 2)


def test_a_model_s_state_dict_saved_again_reuses_its_tables_and_copies_its_bytes_now() -> None:
    # A model's state_dict() gives new tensor objects each time, views of the same parameters:
    # the second plan reuses the first's tables (no tensor is described again), and its copy
    # holds the parameters as they are now.
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    first = flatten.plan_state({"model": model.state_dict(), "step": 1}, 1, 0, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    again = flatten.plan_state({"model": model.state_dict(), "step": 2}, 2, 0, 1)
    assert again.header.tensors is first.header.tensors
    assert again.header.tree != first.header.tree  # the step differs: the tree is new
    data = torch.zeros(again.data_len, dtype=torch.uint8)
    flatten.copy_into(again, data)
    rebuilt = layout.rebuild(again.header, data)
    assert all(torch.equal(rebuilt["model"][k], v) for k, v in model.state_dict().items())
    # Another tensor in its place (new memory): new tables, its bytes.
    model[0].weight = torch.nn.Parameter(torch.full((3, 4), 7.0))
    other = flatten.plan_state({"model": model.state_dict()}, 3, 0, 1)
    assert other.header.tensors is not first.header.tensors
    data = torch.zeros(other.data_len, dtype=torch.uint8)
    flatten.copy_into(other, data)
    assert torch.equal(layout.rebuild(other.header, data)["model"]["0.weight"], model[0].weight)


def test_a_region_copied_into_again_holds_the_state_s_bytes_now() -> None:
    # A save every step copies into the same few regions with the same tables: the views of the
    # region made for the first copy are reused, each copied from the tensor itself (a
    # parameter, a 0-dim step, an int buffer) or from a byte view of its span (a transposed
    # tensor), and the copy records nothing for autograd.
    weight = torch.nn.Parameter(torch.arange(6.0).view(2, 3))
    state = {
        "weight": weight,
        "step": torch.tensor(3.0),
        "count": torch.arange(5, dtype=torch.int64),
        "flag": torch.tensor([True, False]),
        "transposed": torch.arange(6.0, dtype=torch.float64).view(2, 3).t(),
    }
    data = torch.zeros(4096, dtype=torch.uint8)
    for step in (1, 2):
        with torch.no_grad():
            for t in state.values():
                if t.dtype == torch.bool:
                    t.logical_not_()
                else:
                    t.add_(step)
        plan = flatten.plan_state(state, step, 0, 1)
        flatten.copy_into(plan, data)
        assert not data.requires_grad and data.grad_fn is None
        rebuilt = layout.rebuild(plan.header, data)
        assert all(torch.equal(rebuilt[k], v.detach()) for k, v in state.items())


def test_planning_keeps_no_tensor_of_a_state_alive() -> None:
    import gc
    import weakref

    t = torch.arange(6.0)
    ref = weakref.ref(t)
    for step in (1, 2):  # planned, then planned again from the kept tables
        flatten.copy_into(
            flatten.plan_state({"t": t}, step, 0, 1), torch.zeros(64, dtype=torch.uint8)
        )
    del t
    gc.collect()
    assert ref() is None


def test_a_storage_write_calls_between_before_each_block_after_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The persister waits there while a worker copies a save (pipeline.QUIET_BLOCK_WAIT_S at
    # most): writing a large shard takes seconds, the copy it would slow a tenth of one.
    monkeypatch.setattr(storage, "WRITE_BLOCK", 4)
    calls: list[int] = []
    path = tmp_path / "shard"
    storage.atomic_write(
        path, [b"header", memoryview(b"0123456789")], lambda: calls.append(len(calls))
    )
    assert path.read_bytes() == b"header0123456789"
    assert len(calls) == 3  # "head|er", "0123|4567|89": before each block but a part's first


def test_a_storage_is_copied_as_its_bytes_are_when_a_lazy_view_of_it_comes_first() -> None:
    # A conjugate or negative view's bits are lazy: copying the view itself would write its
    # values, not its storage's bytes, which the plain tensor saved beside it reads back.
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    y = torch.tensor([1.0, -2.0])
    state = {"conj": x.conj(), "x": x, "neg": torch._neg_view(y), "y": y}
    plan = flatten.plan_state(state, 1, 0, 1)
    data = torch.zeros(plan.data_len, dtype=torch.uint8)
    flatten.copy_into(plan, data)
    rebuilt = layout.rebuild(plan.header, data)
    assert torch.equal(rebuilt["x"], x) and torch.equal(rebuilt["y"], y)
