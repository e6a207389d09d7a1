"""The torture suite (benchmarks/torture/torture_suite.py): its proxy and checks, and a fast
subset of its scenarios run end to end, each asserting what issue 11 asks (the job succeeds, no
restart or eviction the fault should not cost, final weights bit-identical to a fault-free run,
nothing left behind)."""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path

import pytest

from benchmarks.torture.measure import steps_lost
from benchmarks.torture.scenarios import check
from benchmarks.torture.torture_suite import BY_NAME, run_trial
from transom.testing.store_proxy import StoreProxy

# The fast subset: an etcd stall every node sees, a dead controller leader, a dead node.
FAST = ["etcd_stop_2s", "controller_kill_running", "agent_sigkill"]


@pytest.fixture
def echo_server():
    """A TCP server that echoes what it receives; yields its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    stop.set()
    listener.close()


def round_trip(port: int, payload: bytes, timeout: float) -> tuple[bytes | None, float]:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        try:
            return s.recv(4096), time.monotonic() - started
        except TimeoutError:
            return None, time.monotonic() - started


def test_the_proxy_passes_delays_and_blackholes(echo_server):
    proxy = StoreProxy("127.0.0.1", echo_server, "test")
    try:
        assert round_trip(proxy.port, b"hello", 5)[0] == b"hello"
        proxy.set_delay(0.5)
        answer, took = round_trip(proxy.port, b"slow", 5)
        assert answer == b"slow" and took >= 0.5
        proxy.set_blackhole()
        assert round_trip(proxy.port, b"lost", 0.5)[0] is None  # accepted, never answered
        proxy.set_pass()
        assert round_trip(proxy.port, b"back", 5)[0] == b"back"
    finally:
        proxy.close()


def test_check_names_every_unmet_expectation():
    scenario = BY_NAME["worker_kill_ckpt"]
    row = {"succeeded": True, "identical": True, "wrong_loads": 0, "leftovers": 0}
    row["loss_mismatches"] = []
    assert check(scenario, row | {"restarts": 2, "kills": 2, "evictions": 0}) == []
    unmet = check(scenario, row | {"restarts": 3, "kills": 2, "evictions": 1, "identical": None})
    assert unmet == [
        "identical=None (want == True)",
        "restarts=3 (want == 2)",
        "evictions=1 (want == 0)",
    ]


def test_steps_lost_counts_steps_trained_again_after_a_restart(tmp_path):
    for generation, text in (
        (1, "[train_gpt] resumed step=0 rank=0 t=1.0\nstep 1 loss 3 t=1.1\nstep 14 loss 2 t=2\n"),
        (2, "[train_gpt] resumed step=12 rank=0 t=3.0\nstep 13 loss 2 t=3.1\nstep 20 l 1 t=4\n"),
        (3, "[train_gpt] resumed step=20 rank=0 t=5.0\nstep 21 loss 1 t=5.1\n"),
    ):
        log = tmp_path / "logs" / f"g{generation:03d}" / "rank0.log"
        log.parent.mkdir(parents=True)
        log.write_text(text)
    assert steps_lost(tmp_path) == 2  # 13 and 14 trained twice; none after generation 2


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """One work directory for the module, so the fault-free reference is trained once."""
    return tmp_path_factory.mktemp("torture")


@pytest.mark.slow
@pytest.mark.parametrize("name", FAST)
def test_the_job_rides_out(name, work):
    row = run_trial(BY_NAME[name], work, 0, random.Random(0), kills=1, lock=None)
    assert row["meets"], (row["unmet"], row)
