"""The checkpoint server starts and serves without torch: it only moves bytes, and importing torch
(about 4 s on a small machine, on every node at once) would delay a job's first step.

Its imports are checked in a fresh interpreter, and a running server's mapped files are checked
after it took a save, wrote it to storage and located it for a load (test_checkpoint_prefetch.py
checks the same of servers that replicated, served and prefetched shards)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import standalone_ckpt_server, torch_mapped

from transom.checkpoint import storage

pytestmark = pytest.mark.integration  # its tests start processes

ROOT = Path(__file__).resolve().parents[1]


def test_the_server_and_its_entry_points_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import transom.checkpoint.server, transom.cli, transom.control.ckpt_node\n"
        "from transom.checkpoint.server import main\n"  # what `transom ckpt-server` runs
        "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('torch')]\n"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_a_server_saves_persists_and_locates_a_shard_without_loading_torch(tmp_path: Path) -> None:
    with standalone_ckpt_server(tmp_path, "torchfree", "64M") as (p, engine, storage_dir):
        state = {"w": torch.randn(1000), "b": torch.arange(10, dtype=torch.int16), "step": 4}
        engine.save(4, state).wait("storage", timeout=60)
        assert storage.complete_steps(storage_dir) == [4]
        back = engine.load(4)
        assert engine.last_load.tier == "memory"
        assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
        assert torch_mapped(p.pid) == []
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
