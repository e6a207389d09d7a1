"""The checkpoint engine's GPU path: on a real CUDA device where there is one (those tests are
skipped elsewhere), and its failure path everywhere.

A save of CUDA tensors copies them asynchronously into pinned shared memory and returns; these
tests check that the checkpoint holds the values from the moment of the save while training
changes the tensors at once, that a region the server destroys is unregistered from CUDA before
the worker unmaps it, and that a copy the device fails is a refused save whose region is given
back (benchmarks/checkpoint_gpu.py measures the same path's speed).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from transom import checkpoint
from transom.checkpoint.dcp import TransomReader, TransomWriter
from transom.checkpoint.engine import SaveHandle
from transom.checkpoint.worker_protocol import Region, Reserve

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MIB = 1 << 20


def state_of(n: int, numel: int = 4 * MIB) -> dict:
    g = torch.Generator(device="cuda").manual_seed(n)
    return {f"w{i}": torch.randn(numel, generator=g, device="cuda") for i in range(n)}


@needs_cuda
def test_a_save_holds_the_values_of_its_moment_while_training_changes_them(
    tmp_path: Path,
) -> None:
    state = state_of(8)
    before = {k: v.cpu() for k, v in state.items()}
    with checkpoint.Engine(storage_dir=tmp_path, rank=0, world_size=1) as engine:
        h = engine.save(3, state)
        for v in state.values():
            v.mul_(-2.0)  # the next step's in-place updates, queued at once
        h.wait("storage")
        from_memory = engine.load(3, tier="memory")
        from_storage = engine.load(3, tier="storage", map_location="cuda")
    assert all(torch.equal(before[k], from_memory[k]) for k in before)
    assert all(v.is_cuda and torch.equal(before[k], v.cpu()) for k, v in from_storage.items())


@needs_cuda
def test_regions_the_server_destroys_are_unregistered_and_new_ones_register(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A state that grows every save, under a budget of about three regions: the server destroys
    # the regions of earlier sizes, which this worker had registered with CUDA.
    caplog.set_level(logging.WARNING)
    rounds = 12
    budget = 3 * (rounds + 2) * 4 * MIB * 4
    with checkpoint.Engine(
        storage_dir=tmp_path, rank=0, world_size=1, memory_bytes=budget
    ) as engine:
        for step in range(rounds):
            state = state_of(step + 1)
            h = engine.save(step, state, persist=False)
            h.wait("memory")
            assert len(engine._pinned) == len(engine._maps)  # each open mapping, no other
        loaded = engine.load(rounds - 1, tier="memory")
        assert all(torch.equal(loaded[k], v.cpu()) for k, v in state.items())
    assert len(engine._pinned) == 0
    assert not [r for r in caplog.records if "cudaHost" in r.getMessage()]


@needs_cuda
def test_a_dcp_save_of_a_cuda_model_and_optimizer_loads_back_onto_the_gpu(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    with checkpoint.Engine(storage_dir=tmp_path, rank=0, world_size=1) as engine:
        dcp.save(state, storage_writer=TransomWriter(engine), checkpoint_id=9)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        template = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(template, storage_reader=TransomReader(engine), checkpoint_id=9)
    for k, v in model.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), expected[k])


class FailedCudaEventMock:
    """A torch.cuda.Event whose device failed during the copy. A mock: a device fault cannot be
    caused on purpose, and this test runs on machines without a GPU."""

    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_copy_the_device_fails_is_a_refused_save_and_its_region_is_given_back(
    tmp_path: Path,
) -> None:
    state = {"w": torch.arange(1000.0)}
    with checkpoint.Engine(storage_dir=tmp_path, rank=0, world_size=1) as engine:
        reserve = Reserve(step=5, rank=0, nbytes=4000, world_size=1)
        reply = engine.connection.request(reserve)  # what save() does before its asynchronous copy
        assert isinstance(reply, Region)
        handle = SaveHandle(engine, 5, 0)
        engine._commit_after(handle, {}, True, [FailedCudaEventMock()])
        assert not handle.ok
        with pytest.raises(checkpoint.SaveRefused, match="copy from the GPU failed"):
            handle.wait("memory", timeout=10)  # raises at once, never waits for ever
        again = engine.save(5, state)  # step 5's region was given back: it can be saved again
        again.wait("storage", timeout=30)
        assert torch.equal(engine.load(5, tier="storage")["w"], state["w"])
