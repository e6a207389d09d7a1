"""Memory-only saves (`Engine.save(..., persist=False)`): held in memory (and a peer's), never
written to storage, except each rank's newest one when its server drains (it stops, or an
embedded server closes); and train_gpt's --persist-every, which decides them by step."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transom import checkpoint
from transom.checkpoint import storage
from transom.checkpoint.protocol import deadline_in, recv_msg, send_msg
from transom.checkpoint.shard_header import ShardHeader
from transom.workloads import train_gpt

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"


def _state(step: int) -> dict:
    return {"w": torch.full((1 << 12,), float(step)), "step": step}


def test_a_memory_only_save_skips_storage_and_memory_keeps_the_step_before(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with checkpoint.Engine(storage_dir=root, keep=5) as engine:
        engine.save(1, _state(1)).wait("storage", timeout=30)
        second = engine.save(2, _state(2), persist=False)
        second.wait("memory", timeout=30)
        with pytest.raises(checkpoint.CheckpointError, match="persist=False"):
            second.wait("storage", timeout=30)
        engine.save(3, _state(3), persist=False).wait("memory", timeout=30)
        assert storage.complete_steps(root) == [1]
        assert engine.load()["step"] == 3
        assert engine.last_load.tier == "memory"
        # Memory keeps one step more while the newest is memory-only: a rank that died before
        # saving step 3 makes step 2 the restore step, and only memory has it.
        assert engine.load(2)["step"] == 2
        assert engine.last_load.tier == "memory"
        engine.save(4, _state(4)).wait("storage", timeout=30)
        with pytest.raises(checkpoint.CheckpointError):
            engine.load(2)  # a persisted newest step: one step a rank again
    assert storage.complete_steps(root) == [4, 1]


def test_closing_persists_the_newest_memory_only_step(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with checkpoint.Engine(storage_dir=root, keep=5) as engine:
        engine.save(1, _state(1)).wait("storage", timeout=30)
        for step in (2, 3):
            engine.save(step, _state(step), persist=False).wait("memory", timeout=30)
        assert storage.complete_steps(root) == [1]
    # Closing drained the server: its newest step is in storage, the older memory-only one not.
    assert storage.complete_steps(root) == [3, 1]
    with checkpoint.Engine(storage_dir=root) as engine:
        assert torch.equal(engine.load()["w"], _state(3)["w"])
        assert (engine.last_load.tier, engine.last_load.step) == ("storage", 3)


def test_a_memory_only_save_persisted_later_reaches_storage_and_an_evicted_one_cannot(
    tmp_path: Path,
) -> None:
    """`SaveHandle.persist`: a framework snapshotting every step persists the step its own
    checkpoint schedule saves, without saving it twice."""
    root = tmp_path / "store"
    with checkpoint.Engine(storage_dir=root, keep=2) as engine:
        first = engine.save(1, _state(1), persist=False)
        first.wait("memory", timeout=30)
        later = engine.save(2, _state(2), persist=False, overlap=True)
        later.persist()  # waits for the overlapped copy, then queues it for storage
        later.wait("storage", timeout=30)
        assert storage.complete_steps(root) == [2]
        for step in (3, 4, 5):
            engine.save(step, _state(step), persist=False).wait("memory", timeout=30)
        with pytest.raises(checkpoint.CheckpointError, match="not held"):
            first.persist()  # evicted: nothing to persist, and it says so
    with checkpoint.Engine(storage_dir=root) as engine:
        assert torch.equal(engine.load(2)["w"], _state(2)["w"])
        assert engine.last_load.tier == "storage"


def test_a_commit_whose_persist_is_not_a_boolean_is_refused(tmp_path: Path) -> None:
    with checkpoint.Engine(storage_dir=tmp_path / "store") as engine:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # raw messages
            sock.connect(engine.socket_path)
            reserve = {"op": "reserve", "step": 7, "rank": 0, "nbytes": 64, "world_size": 1}
            send_msg(sock, reserve, deadline_in(10))
            assert recv_msg(sock, deadline_in(10))["ok"]
            header = ShardHeader(7, 0, 1, 64).to_json()
            commit = {"op": "commit", "step": 7, "rank": 0, "header": header, "persist": "no"}
            send_msg(sock, commit, deadline_in(10))
            reply = recv_msg(sock, deadline_in(10))
        assert not reply["ok"] and "persist must be true or false" in reply["error"], reply
        assert engine.steps() == []


@pytest.mark.integration
def test_train_gpt_persists_multiples_of_persist_every_and_its_last_checkpoint(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    args = ["--steps", "50", "--ckpt-every", "10", "--persist-every", "20", "--keep", "5"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--ckpt-dir", str(ckpt), "--n-layer", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert storage.complete_steps(ckpt) == [50, 40, 20]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--persist-every", "-1"], "--persist-every -1: steps, 0 or more"),
        (["--persist-every", "20", "--checkpoint", "torch"], "needs --checkpoint transom"),
    ],
)
def test_train_gpt_refuses_a_bad_persist_every(args, message, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        train_gpt.parse_args(args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
