"""Resharding restore: re-slicing, which steps a world of another size can restore, and real
engines (and real gloo process groups) saving with one world size and loading with another."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from transom import checkpoint
from transom.checkpoint import storage
from transom.checkpoint.load_record import LoadRecord, Resharded
from transom.checkpoint.reshard import chunk_range, copy_overlap
from transom.checkpoint.reshard_steps import restorable
from transom.utils.net import free_port

# -- re-slicing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 7, 10, 12])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_chunks_tile_the_dimension_like_dtensor_shard(n: int, parts: int) -> None:
    ranges = [chunk_range(n, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    expected = [c.shape[0] for c in torch.arange(n).chunk(parts)] if n else []
    assert [e - s for s, e in ranges if e > s] == expected


def test_copy_overlap_moves_only_the_overlapping_block() -> None:
    whole = torch.arange(10 * 6).reshape(10, 6)
    target = torch.full((5, 6), -1)
    target_offsets = [5, 0]  # rank 1 of 2 along dim 0
    copied = 0
    for q in range(3):  # the chunks of 3 saved ranks: rows 0-3, 4-7, 8-9
        lo, hi = chunk_range(10, 3, q)
        copied += copy_overlap(target, target_offsets, whole[lo:hi], [lo, 0])
    assert copied == target.numel() and torch.equal(target, whole[5:])
    # 2-D blocks: a column block placed at an offset in both dimensions
    grid = torch.zeros(4, 4, dtype=torch.long)
    assert copy_overlap(grid, [0, 0], torch.ones(2, 3, dtype=torch.long), [3, 2]) == 2
    assert grid.sum() == 2 and grid[3, 2] == 1 and grid[3, 3] == 1
    assert copy_overlap(grid, [0, 0], torch.ones(1, 1, dtype=torch.long), [9, 9]) == 0
    # what was filled is marked, so a gap between saved chunks is found, not left as garbage
    target, filled = torch.empty(6), torch.zeros(6, dtype=torch.bool)
    copy_overlap(target, [0], torch.ones(2), [0], filled)
    copy_overlap(target, [0], torch.ones(2), [4], filled)
    assert filled.tolist() == [True, True, False, False, True, True]


# -- which steps ----------------------------------------------------------------------------------


def test_a_complete_reshardable_step_of_another_world_is_restorable() -> None:
    entries = [
        *[(10, r, 3, True) for r in range(3)],  # world 3, reshardable, complete
        *[(20, r, 3, False) for r in range(3)],  # world 3, per-rank state only
        *[(30, r, 3, True) for r in range(2)],  # world 3, rank 2 missing
        *[(40, r, 2, False) for r in range(2)],  # this world
    ]
    assert restorable(entries, 2) == {10, 40}
    assert restorable(entries, 3) == {10, 20}
    assert restorable(entries, 5) == {10}
    # a step re-saved by another world mixes shards: each world's set is judged on its own
    mixed = [(50, 0, 2, True), (50, 1, 2, True), (50, 2, 3, True)]
    assert restorable(mixed, 3) == {50} and restorable(mixed[2:], 3) == set()
    assert restorable([(60, 0, "3", True), (60, 0, 0, True)], 1) == set()  # bad world sizes


# -- engines of one world save, engines of another load ----------------------------------------


def _save_world(root: Path, step: int, world: int, replicated=("model", "step")) -> None:
    engines = [checkpoint.Engine(storage_dir=root, rank=r, world_size=world) for r in range(world)]
    try:
        for r, engine in enumerate(engines):
            state = {
                "model": {"w": torch.arange(6.0) * step},
                "step": step,
                "data_position": torch.tensor([r]),  # per-rank
            }
            assert engine.save(step, state, replicated=replicated).ok
    finally:
        for engine in engines:
            engine.close()


def _load_world(root: Path, world: int) -> list[tuple[dict, LoadRecord]]:
    out = []
    for r in range(world):
        with checkpoint.Engine(storage_dir=root, rank=r, world_size=world) as engine:
            state = engine.load()
            out.append((state, engine.last_load))
    return out


def test_shrink_then_grow_resumes_from_the_newest_step(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _save_world(root, 10, 3)
    assert storage.restorable_steps(root, 2) == [10] and storage.restorable_steps(root, 3) == [10]
    for r, (state, info) in enumerate(_load_world(root, 2)):  # shrink: 3 -> 2
        assert state["step"] == 10 and torch.equal(state["model"]["w"], torch.arange(6.0) * 10)
        assert "data_position" not in state, "per-rank state of another world is left out"
        assert info.resharded == Resharded(3, r, ("data_position",)) and info.tier == "storage"
    _save_world(root, 20, 2)
    loaded = _load_world(root, 3)  # grow: 2 -> 3; rank 2 has no shard of its own
    assert [s["step"] for s, _ in loaded] == [20, 20, 20]
    assert all(torch.equal(s["model"]["w"], torch.arange(6.0) * 20) for s, _ in loaded)
    assert loaded[2][1].resharded.source_rank == 0
    same = _load_world(root, 2)  # the same world: its own shard, bit for bit, nothing left out
    assert all(info.resharded is None for _, info in same)
    assert [int(s["data_position"]) for s, _ in same] == [0, 1]


def test_a_step_without_a_resharding_record_is_not_loaded_by_another_world(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    _save_world(root, 10, 2, replicated=())
    assert storage.restorable_steps(root, 3) == [] and storage.restorable_steps(root, 2) == [10]
    with checkpoint.Engine(storage_dir=root, rank=0, world_size=3) as engine:
        assert engine.load() is None  # nothing restorable: a fresh start, no wrong bytes
        with pytest.raises(checkpoint.CheckpointError, match="without a resharding record"):
            engine.load(10)  # asked for explicitly: refused with the reason
    with checkpoint.Engine(storage_dir=root, rank=2, world_size=3) as engine:
        with pytest.raises(checkpoint.CheckpointError, match="without a resharding record"):
            engine.load(10)


# -- DTensors and DCP across real process groups --------------------------------------------------

RANK_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from transom import checkpoint
    from transom.checkpoint.dcp import TransomReader, TransomWriter
    root, phase, load_step, save_step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def state(scale):
        w = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3) * scale
        return {
            "w": distribute_tensor(w, mesh, [Shard(0)]),
            "r": distribute_tensor(torch.full((4,), scale), mesh, [Replicate()]),
        }

    out = {}
    with checkpoint.Engine(storage_dir=root) as engine:
        if load_step:
            expected = state(load_step)
            back = engine.load(load_step)  # plain Engine.save of DTensors, resharded
            local = expected["w"].to_local()
            out["engine_w"] = torch.equal(back["w"], local)
            out["engine_r"] = torch.equal(back["r"], expected["r"].to_local())
            out["dropped"] = engine.last_load.resharded.dropped
            template = state(0)
            dcp.load(template, storage_reader=TransomReader(engine), checkpoint_id=load_step + 1)
            out["dcp_w"] = torch.equal(template["w"].full_tensor(), expected["w"].full_tensor())
            out["dcp_r"] = torch.equal(template["r"].to_local(), expected["r"].to_local())
        if save_step:
            s = state(save_step)
            engine.save(save_step, {**s, "rank": rank}).wait("storage", timeout=60)
            dcp.save(state(save_step), storage_writer=TransomWriter(engine),
                     checkpoint_id=save_step + 1)
    print("RESULT", json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


def _run_world(script: Path, root: Path, world: int, load_step: int, save_step: int) -> list:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, str(script), str(root), "x", str(load_step), str(save_step)]
    procs = [
        subprocess.Popen(
            argv, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=180)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), outs
    import json

    return [
        json.loads(next(line for line in o.splitlines() if line.startswith("RESULT "))[7:])
        for o in outs
    ]


@pytest.mark.slow
def test_dtensor_state_reshards_3_to_2_to_3_through_engine_and_dcp(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    root = tmp_path / "store"
    _run_world(script, root, 3, 0, 10)  # 3 ranks save step 10 (engine) and 11 (DCP)
    assert storage.complete_steps(root) == [11, 10]
    assert storage.restorable_steps(root, 2) == [11, 10]
    shrunk = _run_world(script, root, 2, 10, 20)  # 2 ranks load them, save 20 and 21
    grown = _run_world(script, root, 3, 20, 0)  # 3 ranks load those
    for result in shrunk + grown:
        assert result["engine_w"] and result["engine_r"], result
        assert result["dcp_w"] and result["dcp_r"], result
        assert result["dropped"] == ["rank"], result
