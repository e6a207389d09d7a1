"""The store against a real etcd that stalls, dies and fills up: retries, upkeep, restart."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import running_etcd, wait_for
from etcd3gw import exceptions as etcd_errors

from transom.store import EmbeddedEtcd, Store, StoreError
from transom.store.reachability import StoreOutage
from transom.store.upkeep import ROOMY_FACTOR, EtcdUpkeep

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def etcd(tmp_path):
    with running_etcd(tmp_path / "etcd", quota_bytes=8 << 20) as server:
        yield server


def _stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (a signal is delivered to each thread
    of a busy process when it next leaves the CPU: on a loaded machine, not at once)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue  # a thread that just exited
    return bool(states) and all(state in ("T", "t") for state in states)


def paused(etcd: EmbeddedEtcd, seconds: float) -> threading.Thread:
    """SIGSTOP etcd now (returning once it has stopped) and SIGCONT it after `seconds` (in a
    thread)."""
    assert etcd.process is not None
    pid = etcd.process.pid
    os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
    resume.start()
    wait_for(lambda: _stopped(pid), seconds, "etcd to stop")
    return resume


def test_a_call_in_flight_rides_out_a_two_second_stall(etcd):
    store = Store(etcd.access, f"j-{uuid.uuid4().hex[:8]}", deadline_s=6.0)
    store.put("k", 1)
    resume = paused(etcd, 2.0)
    start = time.monotonic()
    store.put("k", 2)  # in flight while etcd is stopped
    took = time.monotonic() - start
    resume.join()
    assert store.get("k") == 2
    assert 1.5 < took < 6.0


def test_a_stall_longer_than_the_deadline_raises_within_it(etcd):
    store = Store(etcd.access, f"j-{uuid.uuid4().hex[:8]}", deadline_s=2.0)
    store.put("k", 1)
    resume = paused(etcd, 5.0)
    start = time.monotonic()
    with pytest.raises(StoreError, match=r"cannot reach etcd .* gave up after"):
        store.get("k")
    took = time.monotonic() - start
    assert 1.9 < took < 2.0 + 1.0  # the deadline, plus at most one attempt's minimum
    resume.join()
    assert store.get("k") == 1  # and it answers again once etcd does


def test_an_outage_lasts_from_etcds_last_answer_to_its_next(etcd):
    """The one definition of "etcd is unreachable" (store/reachability.py, shared by the launcher
    and the agents): it began when etcd last answered, not when the first failed call gave up (a
    call waits out the store's deadline first), and ends with the next answer."""
    store = Store(etcd.access, f"j-{uuid.uuid4().hex[:8]}", deadline_s=1.0)
    outage = StoreOutage("test")
    store.put("k", 1)
    outage.ok()
    answered = time.monotonic()
    resume = paused(etcd, 3.0)
    with pytest.raises(StoreError) as failure:
        store.get("k")
    lasted = outage.failed(failure.value)
    assert outage.in_outage and lasted >= time.monotonic() - answered - 0.1
    assert lasted >= 0.9  # the deadline the failed call waited out counts
    resume.join()
    assert store.get("k") == 1
    ended = outage.ok()
    assert ended is not None and ended >= 3.0 - 0.1 and not outage.in_outage
    assert outage.ok() is None and outage.lasted() == 0.0


def test_a_create_whose_answer_was_lost_is_still_ours(etcd):
    store = Store(etcd.access, f"j-{uuid.uuid4().hex[:8]}")
    real = store.client.transaction
    lost: list[bool] = []

    def answer_lost_once(txn):
        result = real(txn)  # etcd applies it...
        if not lost:
            lost.append(True)
            raise etcd_errors.ConnectionTimeoutError("read timed out")  # ...the answer is lost
        return result

    store.client.transaction = answer_lost_once  # type: ignore[method-assign]
    assert store.create("leader", "me") is True
    assert lost == [True]
    store.client.transaction = real  # type: ignore[method-assign]
    assert store.create("leader", "someone else") is False  # and another caller's create fails
    assert store.get("leader") == "me"


def test_a_full_database_is_compacted_defragmented_and_disarmed(etcd):
    """With an 8 MiB quota, rewriting one key with 256 KiB values fills it within ~30 writes;
    the upkeep frees it each time and every write succeeds (the writers' retries wait for it).
    The size after the last write may be anything up to the quota and a little over (etcd checks
    the quota before a write): what the upkeep freed is what is checked."""
    store = Store(etcd.access, f"j-{uuid.uuid4().hex[:8]}", deadline_s=30.0)
    upkeep = EtcdUpkeep(
        Store(etcd.access, store.job_id, timeout=30.0, deadline_s=30.0),
        etcd.quota_bytes,
        check_every_s=0.5,
    ).start()
    try:
        start_size = upkeep.status().db_size
        payload = "x" * (256 << 10)
        for i in range(200):  # 50 MiB written in all, six times the quota
            store.put("blob", {"i": i, "data": payload})
        assert store.get("blob")["i"] == 199
        assert upkeep.alarms_handled >= 1
        print(
            f"db size: {start_size}, then full and freed: {upkeep.freed} (quota {etcd.quota_bytes})"
        )
        for before, after in upkeep.freed:
            assert before >= etcd.quota_bytes * 0.9 and after < etcd.quota_bytes / 4
        events = store.get_prefix("events/")
        assert any("NOSPACE" in e["message"] for e in events.values())
    finally:
        upkeep.stop()


def test_a_check_of_an_etcd_with_room_is_one_request(etcd):
    """The upkeep runs for the job's life: etcd's status (which lists raised alarms) is all a
    pass asks while the database has room, and the next pass is ROOMY_FACTOR times later while
    the database is under half its quota."""
    store = Store(etcd.access, f"j-{uuid.uuid4().hex[:8]}")
    asked: list[str] = []
    request = store.request

    def counted(path: str, body: dict, deadline_s: float | None = None) -> dict:
        asked.append(path)
        return request(path, body, deadline_s)

    store.request = counted  # type: ignore[method-assign]
    upkeep = EtcdUpkeep(store, etcd.quota_bytes)
    assert upkeep.check() == [] and asked == ["maintenance/status"]
    assert upkeep.status().full is False
    assert upkeep.wait_s == upkeep.check_every_s * ROOMY_FACTOR


def test_a_killed_etcd_restarts_from_its_data_with_its_certificates(etcd):
    store = Store(etcd.access, f"j-{uuid.uuid4().hex[:8]}", deadline_s=10.0)
    store.put("kept", {"v": 1})
    assert etcd.process is not None
    etcd.process.send_signal(signal.SIGKILL)
    etcd.process.wait()
    assert not etcd.alive()
    etcd.restart()
    assert etcd.alive() and etcd.restarts == 1
    assert store.get("kept") == {"v": 1}  # same port, same client certificate, same data


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = (item.decode().partition("=") for item in f.read().split(b"\0") if item)
        return {name: value for name, _, value in pairs}


@pytest.mark.integration
def test_an_etcd_for_one_machine_runs_on_the_go_threads_asked_for_also_after_a_restart(tmp_path):
    with running_etcd(tmp_path / "etcd", go_threads=1) as server:
        assert server.process is not None
        assert _environ(server.process.pid)["GOMAXPROCS"] == "1"
        server.restart()
        assert _environ(server.process.pid)["GOMAXPROCS"] == "1"
        assert Store(server.access, "j").healthy()
