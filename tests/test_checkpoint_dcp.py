"""torch.distributed.checkpoint through Transom's tiers: round trip; 2 ranks saved, 1 loads."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from transom import checkpoint
from transom.checkpoint.dcp import TransomReader, TransomWriter
from transom.utils.net import free_port

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def test_dcp_save_and_load_go_through_memory_and_storage(tmp_path: Path) -> None:
    state: dict[str, Any] = {
        "w": torch.randn(4, 5),
        "b": torch.arange(3),
        "lr": 0.5,
        "nested": {"x": torch.ones(2, dtype=torch.bfloat16)},
    }

    def template():
        return {
            "w": torch.zeros(4, 5),
            "b": torch.zeros(3, dtype=torch.long),
            "lr": 0.0,
            "nested": {"x": torch.zeros(2, dtype=torch.bfloat16)},
        }

    with checkpoint.Engine(storage_dir=tmp_path) as engine:
        dcp.save(state, storage_writer=TransomWriter(engine), checkpoint_id=5)
        back = template()
        dcp.load(back, storage_reader=TransomReader(engine), checkpoint_id=5)
        assert engine.last_load.tier == "memory"
        assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
        assert back["lr"] == 0.5 and torch.equal(back["nested"]["x"], state["nested"]["x"])
    with checkpoint.Engine(storage_dir=tmp_path) as engine:  # a new process: from storage
        back = template()
        dcp.load(back, storage_reader=TransomReader(engine), checkpoint_id=5)
        assert engine.last_load.tier == "storage" and torch.equal(back["w"], state["w"])


def test_a_dcp_save_can_be_memory_only(tmp_path: Path) -> None:
    state = {"w": torch.randn(4, 5)}
    with checkpoint.Engine(storage_dir=tmp_path) as engine:
        writer = TransomWriter(engine, persist=False)
        dcp.save(state, storage_writer=writer, checkpoint_id=6)
        assert writer.handle is not None
        writer.handle.wait("memory", timeout=30)
        with pytest.raises(checkpoint.CheckpointError, match="persist=False"):
            writer.handle.wait("storage", timeout=30)
        back = {"w": torch.zeros(4, 5)}
        dcp.load(back, storage_reader=TransomReader(engine), checkpoint_id=6)
        assert engine.last_load.tier == "memory" and torch.equal(back["w"], state["w"])


def test_dcp_round_trips_an_optimizer_state_with_0_dim_tensors(tmp_path: Path) -> None:
    # An optimizer's `step` is a 0-dim tensor: its chunk offset is empty, not absent, and the
    # reader must find it under the same index (it was looked up as a bytes item's).
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    saved = {"model": model.state_dict(), "optim": opt.state_dict(), "scale": torch.tensor(8.0)}
    expected = copy.deepcopy(saved)
    with checkpoint.Engine(storage_dir=tmp_path) as engine:
        dcp.save(saved, storage_writer=TransomWriter(engine), checkpoint_id=3)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt.state[model.weight]["step"].zero_()
    back = {"model": model.state_dict(), "optim": opt.state_dict(), "scale": torch.tensor(0.0)}
    with checkpoint.Engine(storage_dir=tmp_path) as engine:  # from storage
        dcp.load(back, storage_reader=TransomReader(engine), checkpoint_id=3)
    assert torch.equal(back["scale"], expected["scale"])
    for k, v in expected["model"].items():
        assert torch.equal(back["model"][k], v)
    for i, state in expected["optim"]["state"].items():
        for k, v in state.items():
            assert torch.equal(back["optim"]["state"][i][k], v), (i, k)


RANK_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from transom import checkpoint
    from transom.checkpoint.dcp import TransomWriter
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    shared = torch.randn(6, 3)                       # the same on both ranks: DCP saves it once
    own = torch.full((5,), float(rank))              # rank-specific
    with checkpoint.Engine(storage_dir=sys.argv[1]) as engine:
        writer = TransomWriter(engine)
        dcp.save({"shared": shared, f"own{rank}": own}, storage_writer=writer, checkpoint_id=7)
    dist.destroy_process_group()
""")


@pytest.mark.integration
def test_two_ranks_saved_one_rank_loads_everything(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "store")],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), outs
    torch.manual_seed(0)
    expected = torch.randn(6, 3)
    back = {"shared": torch.zeros(6, 3), "own0": torch.zeros(5), "own1": torch.zeros(5)}
    with checkpoint.Engine(storage_dir=tmp_path / "store", rank=0, world_size=1) as engine:
        dcp.load(back, storage_reader=TransomReader(engine), checkpoint_id=7)
    assert torch.equal(back["shared"], expected)
    assert torch.equal(back["own0"], torch.zeros(5)) and torch.equal(back["own1"], torch.ones(5))
