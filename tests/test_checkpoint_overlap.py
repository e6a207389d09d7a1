"""Overlapped saves (checkpoint/overlap.py): `save(..., overlap=True)` returns before the state's
bytes are copied, the next optimizer step waits for the copy, and the step saved is the state as
it was when `save` was called, bit for bit."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from transom import checkpoint
from transom.checkpoint import engine as engine_module
from transom.checkpoint import flatten


def _engine(tmp_path: Path) -> checkpoint.Engine:
    return checkpoint.Engine(storage_dir=tmp_path / "ckpt", rank=0, world_size=1)


def test_the_next_optimizer_step_waits_for_the_copy_and_the_step_saved_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    release, copying = threading.Event(), threading.Event()
    real_copy = flatten.copy_into

    def held_copy(plan, data, non_blocking=False):
        copying.set()
        assert release.wait(30), "the test never released the copy"
        real_copy(plan, data, non_blocking)

    monkeypatch.setattr(engine_module.flatten, "copy_into", held_copy)
    engine = _engine(tmp_path)
    try:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        handle = engine.save(1, state, overlap=True)
        assert handle.ok and copying.wait(30)  # returned while its copy is held
        model(torch.randn(4, 64)).sum().backward()  # the next step's forward and backward
        stepped = threading.Event()
        stepper = threading.Thread(target=lambda: (optimizer.step(), stepped.set()))
        stepper.start()
        assert not stepped.wait(0.5)  # the optimizer step waits for the copy...
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        release.set()
        assert stepped.wait(30)  # ...and runs once it is done
        stepper.join()
        handle.wait("memory", timeout=30)
        assert not torch.equal(model.weight, before["weight"])
        loaded = engine.load(step=1)
        assert all(torch.equal(loaded["model"][k], v) for k, v in before.items())
    finally:
        release.set()
        engine.close()


@pytest.mark.parametrize("as_keyword", [True, False])
def test_a_step_given_a_closure_runs_it_beside_the_copy_and_waits_before_changing_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_keyword: bool
) -> None:
    """Lightning's automatic optimisation (and LBFGS) run the forward and backward inside the
    step, in its closure: the closure runs while the copy is held, the update only after it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    release, copying, closed = threading.Event(), threading.Event(), threading.Event()
    real_copy = flatten.copy_into

    def held_copy(plan, data, non_blocking=False):
        copying.set()
        assert release.wait(30), "the test never released the copy"
        real_copy(plan, data, non_blocking)

    def closure():
        optimizer.zero_grad()
        loss = model(torch.randn(4, 64)).sum()
        loss.backward()
        closed.set()
        return loss

    monkeypatch.setattr(engine_module.flatten, "copy_into", held_copy)
    engine = _engine(tmp_path)
    try:
        handle = engine.save(1, {"model": model.state_dict()}, overlap=True)
        assert handle.ok and copying.wait(30)
        step = (
            (lambda: optimizer.step(closure=closure))
            if as_keyword
            else (lambda: optimizer.step(closure))
        )
        losses: list[torch.Tensor] = []
        stepper = threading.Thread(target=lambda: losses.append(step()))
        stepper.start()
        assert closed.wait(30)  # the forward and backward ran while the copy was held...
        stepper.join(0.5)
        assert stepper.is_alive()  # ...and the update waits for the copy
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        release.set()
        stepper.join(30)
        assert not stepper.is_alive() and losses and losses[0] is not None  # the closure's loss
        assert not torch.equal(model.weight, before["weight"])
        handle.wait("memory", timeout=30)
        loaded = engine.load(step=1)
        assert all(torch.equal(loaded["model"][k], v) for k, v in before.items())
    finally:
        release.set()
        engine.close()


def test_a_failed_overlapped_copy_is_a_failed_save_and_the_next_one_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_copy = flatten.copy_into

    def broken_copy(plan, data, non_blocking=False):
        raise RuntimeError("the copy broke")

    engine = _engine(tmp_path)
    try:
        monkeypatch.setattr(engine_module.flatten, "copy_into", broken_copy)
        failed = engine.save(1, {"w": torch.ones(100)}, overlap=True)
        with pytest.raises(checkpoint.CheckpointError, match="the copy broke"):
            failed.wait("memory", timeout=30)
        monkeypatch.setattr(engine_module.flatten, "copy_into", real_copy)
        engine.save(2, {"w": torch.full((100,), 2.0)}, overlap=True).wait("memory", timeout=30)
        assert torch.equal(engine.load(step=2)["w"], torch.full((100,), 2.0))
        with pytest.raises(checkpoint.CheckpointError):
            engine.load(step=1)  # nothing of the failed save is kept
    finally:
        engine.close()


def test_saves_every_step_take_a_region_reserved_ahead_and_a_jump_gives_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once two saves came one step apart, the copy thread reserves the next step's region
    (next_region.ReservedAhead): the training thread sends no reserve, the saves hold the state
    as it was, and a save of another step gives the reservation back (nothing stays reserved)."""
    from transom.checkpoint import worker_protocol as wire

    reserves_from_training: list[int] = []
    engine = _engine(tmp_path)
    real_request = engine.connection.request

    def request(req, *args, **kwargs):
        if isinstance(req, wire.Reserve) and threading.current_thread().name != "ckpt-copy":
            reserves_from_training.append(req.step)
        return real_request(req, *args, **kwargs)

    monkeypatch.setattr(engine.connection, "request", request)
    t = torch.zeros(256)
    try:
        for step in range(1, 6):
            t.fill_(float(step))
            assert engine.save(step, {"t": t}, overlap=True).ok
        engine._copy.wait_finished()
        assert reserves_from_training == [1, 2]  # from the third save on: reserved ahead
        held = engine.connection.request(wire.StatusRequest())
        assert isinstance(held, wire.Status)
        states = {(s.step, s.state) for s in held.shards}
        assert (6, "reserved") in states  # the next step's region, ahead of its save
        t.fill_(10.0)
        assert engine.save(10, {"t": t}, overlap=True).ok  # not step 6: reserved as ever
        engine._copy.wait_finished()
        assert reserves_from_training == [1, 2, 10]
        held = engine.connection.request(wire.StatusRequest())
        assert isinstance(held, wire.Status)
        assert all(s.state != "reserved" for s in held.shards)
        assert torch.equal(engine.load(step=5)["t"], torch.full((256,), 5.0))
        assert torch.equal(engine.load(step=10)["t"], torch.full((256,), 10.0))
    finally:
        engine.close()


def test_a_region_reserved_ahead_does_not_hold_back_the_saves_checksums_or_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's background work waits while a worker copies a save (pipeline._quiet); a
    region reserved ahead of the next save is no copy: the step saved reaches memory at once, not
    when the next step commits (or, after the last step, QUIET_WAIT_S later), and its copy in
    storage (or a peer's memory) follows at once."""
    from transom.checkpoint import pipeline
    from transom.checkpoint import worker_protocol as wire

    monkeypatch.setattr(pipeline, "QUIET_WAIT_S", 120.0)
    engine = _engine(tmp_path)
    t = torch.zeros(256)
    try:
        handles = []
        for step in range(1, 6):
            t.fill_(float(step))
            handles.append(engine.save(step, {"t": t}, overlap=True))
        engine._copy.wait_finished()
        held = engine.connection.request(wire.StatusRequest())
        assert isinstance(held, wire.Status)
        assert (6, "reserved") in {(s.step, s.state) for s in held.shards}
        # with step 6 reserved, nothing more will come: step 5 is checksummed and persisted now
        handles[-1].wait("storage", timeout=20)
    finally:
        engine.close()
