"""torch.distributed.checkpoint (the torchtitan way of checkpointing) through transom.checkpoint:
DCP's own `dcp.save` and `dcp.load` across 2 ranks of a gloo process group, with
`TransomWriter`/`TransomReader` as the storage writer and reader: a second process group loads
what the first saved, each rank its own tensor and the replicated one. (In DCP a plain tensor
under the same key on every rank is replicated: one copy is saved; per-rank values need keys of
their own, or DTensors.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from transom.utils.net import free_port

pytestmark = pytest.mark.integration  # two real ranks over gloo

SAVE_THEN_LOAD = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from transom import checkpoint
    from transom.checkpoint.dcp import TransomReader, TransomWriter
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with checkpoint.Engine(storage_dir=sys.argv[1]) as engine:
        if sys.argv[2] == "save":
            torch.manual_seed(0)
            state = {"model": {"w": torch.randn(6, 3)}, f"own{rank}": torch.full((4,), rank + 1.0)}
            dcp.save(state, storage_writer=TransomWriter(engine), checkpoint_id=5)
        else:
            state = {"model": {"w": torch.zeros(6, 3)}, f"own{rank}": torch.zeros(4)}
            dcp.load(state, storage_reader=TransomReader(engine), checkpoint_id=5)
            torch.manual_seed(0)
            assert torch.equal(state["model"]["w"], torch.randn(6, 3)), state
            assert torch.equal(state[f"own{rank}"], torch.full((4,), rank + 1.0)), state
            print(f"loaded rank={rank}", flush=True)
    dist.destroy_process_group()
""")


def ranks(tmp_path: Path, script: Path, mode: str) -> list[str]:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "store"), mode],
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
    assert [p.returncode for p in procs] == [0, 0], outs
    return outs


def test_dcp_saves_and_loads_through_the_engine_across_two_ranks(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SAVE_THEN_LOAD)
    ranks(tmp_path, script, "save")
    outs = ranks(tmp_path, script, "load")  # new processes: from the storage tier
    assert "loaded rank=0" in outs[0] and "loaded rank=1" in outs[1], outs
