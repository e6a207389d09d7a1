"""Worker <-> server requests with time limits: a server that never answers, or answers too
late, turns a save into a refused save (reported) and a load into one from the next tier; a
stalled or malformed worker connection does not stop the server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import shm_dir_for, wait_for

from transom import checkpoint
from transom.checkpoint import engine as engine_mod
from transom.checkpoint import worker_service
from transom.checkpoint.protocol import LENGTH
from transom.checkpoint.server import CheckpointServer
from transom.checkpoint.server_options import ServerConfig


def _server(tmp_path: Path) -> CheckpointServer:
    cfg = ServerConfig(
        node_id="n0",
        socket_path=tmp_path / "n0.sock",
        shm_dir=shm_dir_for(tmp_path, "-n0"),
        budget_bytes=1 << 30,
        replicas=0,
    )
    return CheckpointServer(cfg).start()


def _events_of(server: CheckpointServer, monkeypatch) -> list[tuple[str, str]]:
    """The (action, message) of every event `server` publishes from now on."""
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(
        server.publisher, "event", lambda action, message, **f: events.append((action, message))
    )
    return events


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_load_waits_for_checksums_longer_than_the_server_does() -> None:
    assert worker_service.STAGED_WAIT_S < engine_mod.LOCATE_TIMEOUT_S


# -- a server that does not answer -----------------------------------------------------------


@pytest.fixture
def silent_server(tmp_path: Path):
    """A Unix socket that accepts connections and never answers."""
    path = tmp_path / "silent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield str(path)
    finally:
        stop.set()
        thread.join()
        for sock in accepted:
            sock.close()
        listener.close()


def test_a_save_to_a_server_that_never_answers_is_refused_in_time(
    tmp_path: Path, silent_server: str
) -> None:
    root = tmp_path / "store"
    state = {"w": torch.randn(1000)}
    with checkpoint.Engine(storage_dir=root) as embedded:  # a copy in storage to load later
        embedded.save(4, state).wait("storage", timeout=30)
    engine = checkpoint.Engine(
        socket_path=silent_server, rank=0, world_size=1, storage_dir=root, request_timeout_s=1.0
    )
    engine.locate_timeout_s = 1.0
    try:
        t0 = time.monotonic()
        handle = engine.save(5, state)
        took = time.monotonic() - t0
        assert 1.0 <= took < 2.5, took
        assert not handle.ok and "no answer" in handle.error
        with pytest.raises(checkpoint.SaveRefused, match="within 1 s"):
            handle.wait("memory")
        # A load falls back to the tier it reaches itself: storage.
        t0 = time.monotonic()
        assert _same(state, engine.load())
        assert engine.last_load.tier == "storage" and engine.last_load.step == 4
        assert time.monotonic() - t0 < 10
    finally:
        engine.close()


def test_a_save_while_the_node_server_is_down_is_refused_and_the_next_reaches_its_successor(
    tmp_path: Path,
) -> None:
    """A killed server (the agent starts a new one at the same socket) costs a refused save,
    not the worker (torture suite, server_kill_ckpt: every kill cost a job restart)."""
    state = {"w": torch.randn(1000)}
    engine = checkpoint.Engine(
        socket_path=str(tmp_path / "n0.sock"), rank=0, world_size=1, request_timeout_s=5.0
    )
    server = None
    try:
        handle = engine.save(1, state)  # no server listens yet
        assert not handle.ok and "cannot reach the checkpoint server" in handle.error
        with pytest.raises(checkpoint.SaveRefused):
            handle.wait("memory")
        server = _server(tmp_path)  # the new server
        handle = engine.save(2, state)
        assert handle.ok, handle.error
        handle.wait("memory", timeout=30)
        assert _same(state, engine.load(2))
    finally:
        engine.close()
        if server is not None:
            server.stop()


def test_a_stuck_reserve_is_a_refused_save_reported_as_an_event(
    tmp_path: Path, monkeypatch
) -> None:
    server = _server(tmp_path)
    events = _events_of(server, monkeypatch)
    release = threading.Event()
    reserve = server.memory.reserve

    def stuck_reserve(*args, **kwargs):
        release.wait(30)
        return reserve(*args, **kwargs)

    monkeypatch.setattr(server.memory, "reserve", stuck_reserve)
    engine = checkpoint.Engine(
        socket_path=str(tmp_path / "n0.sock"), rank=0, world_size=1, request_timeout_s=1.0
    )
    try:
        state = {"w": torch.randn(1000)}
        t0 = time.monotonic()
        handle = engine.save(1, state)
        assert time.monotonic() - t0 < 2.5
        assert not handle.ok
        wait_for(lambda: any(a == "refused" for a, _ in events), 10, "a refused event")
        release.set()  # the server recovers: the late region is given back, saves work again
        handle = engine.save(2, state)
        assert handle.ok, handle.error
        handle.wait("memory", timeout=30)
        wait_for(lambda: (1, 0) not in server.memory.shards, 10, "the late region to go back")
        assert _same(state, engine.load(2))
    finally:
        release.set()
        engine.close()
        server.stop()


def test_a_slow_worker_connection_does_not_stop_the_server(tmp_path: Path) -> None:
    server = _server(tmp_path)
    engine = checkpoint.Engine(socket_path=str(tmp_path / "n0.sock"), rank=0, world_size=1)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:
            stalled.connect(str(tmp_path / "n0.sock"))
            stalled.sendall(LENGTH.pack(100) + b'{"op":')  # half a request, then nothing
            for body in (b"[" * 60000, b'{"op": "reserve", "step": "x"}'):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bad:
                    bad.connect(str(tmp_path / "n0.sock"))
                    bad.sendall(LENGTH.pack(len(body)) + body)
                    bad.shutdown(socket.SHUT_WR)
                    while bad.recv(4096):
                        pass
            assert engine.save(1, {"w": torch.ones(10)}).ok
    finally:
        engine.close()
        server.stop()


def _stuck_commits(server: CheckpointServer, monkeypatch) -> tuple[threading.Event, ...]:
    """(entered, release, done): the server's commits wait for `release` (10 s at most);
    `entered` is set when one waits, `done` when one is done."""
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    commit = server.pipeline.commit

    def stuck_commit(*args, **kwargs):
        entered.set()
        release.wait(10)
        try:
            return commit(*args, **kwargs)
        finally:
            done.set()

    monkeypatch.setattr(server.pipeline, "commit", stuck_commit)
    return entered, release, done


def test_a_save_returns_before_its_commit_is_answered(tmp_path: Path, monkeypatch) -> None:
    """The commit's reply is read later (with the next request, or by `wait`): a save blocks
    training for its copy, not for the server's turn on the node's CPUs."""
    server = _server(tmp_path)
    entered, release, done = _stuck_commits(server, monkeypatch)
    engine = checkpoint.Engine(
        socket_path=str(tmp_path / "n0.sock"), rank=0, world_size=1, request_timeout_s=30.0
    )
    try:
        state = {"w": torch.randn(1000)}
        handle = engine.save(1, state)
        assert not done.is_set(), "the save waited for its commit"
        assert entered.wait(10) and handle.ok  # the commit reached the server, which holds it
        with pytest.raises(TimeoutError, match="not staged"):  # its own time limit, not 30 s
            handle.wait("memory", timeout=0.5)
        assert not done.is_set()
        release.set()
        handle.wait("memory", timeout=30)
        assert handle.ok, handle.error
        assert _same(state, engine.load(1))
    finally:
        release.set()
        engine.close()
        server.stop()


def test_a_stuck_commit_is_a_refused_save_when_its_reply_is_awaited(
    tmp_path: Path, monkeypatch
) -> None:
    server = _server(tmp_path)
    events = _events_of(server, monkeypatch)
    entered, release, _ = _stuck_commits(server, monkeypatch)
    engine = checkpoint.Engine(
        socket_path=str(tmp_path / "n0.sock"), rank=0, world_size=1, request_timeout_s=1.0
    )
    try:
        state = {"w": torch.randn(1000)}
        handle = engine.save(1, state)
        assert entered.wait(10) and handle.ok  # nothing known yet
        with pytest.raises(checkpoint.SaveRefused, match="no answer to 'commit'"):
            handle.wait("memory")
        assert not handle.ok
        wait_for(lambda: any(a == "refused" for a, _ in events), 10, "a refused event")
        release.set()  # the server recovers: the next save reaches it on a new connection
        handle = engine.save(2, state)
        handle.wait("memory", timeout=30)
        assert handle.ok, handle.error
        assert _same(state, engine.load(2))
    finally:
        release.set()
        engine.close()
        server.stop()
