"""The worker API talking to a real agent-side NodeMonitor over its monitor channel (a Unix
datagram socket), log scanning, MockNvml hardware signals, and the fault schedule parser."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import torch
from conftest import wait_for

from transom.common import env
from transom.faults import DEFAULT_LOG_LINE, MockNvml
from transom.monitor import datagram, reporter
from transom.monitor import node as node_module
from transom.monitor.node import NodeMonitor
from transom.monitor.rank_timing import WARMUP_STEPS


@pytest.fixture
def node(monkeypatch):
    """A NodeMonitor and a fresh worker-side channel pointed at it, as rank 3 of generation 0."""
    monitor = NodeMonitor("nodeX", nvml=MockNvml())
    monitor.expect_ranks([3])
    monkeypatch.setenv(env.MONITOR_SOCKET, str(monitor.socket_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv(env.GENERATION, "0")
    monkeypatch.setattr(reporter, "_channel", None)
    yield monitor
    monitor.close()


def test_calls_are_no_ops_without_an_agent(monkeypatch):
    monkeypatch.delenv(env.MONITOR_SOCKET, raising=False)
    monkeypatch.setattr(reporter, "_channel", None)
    with reporter.step(1) as s:
        with s.section("sync"):
            pass
        s.report(loss=1.0, tokens=10)
        assert s.inject(2.0) == 2.0
    with reporter.phase("checkpoint"):
        reporter.report(1, loss=float("nan"))
    assert reporter._channel is None


def published(node: NodeMonitor) -> tuple[dict, list[dict]]:
    """What the agent writes to etcd: the summary and the anomaly events as stored values."""
    summary, events = node.collect()
    return summary.to_dict(), [e.to_dict() for e in events]


def test_steps_sections_and_heartbeats_reach_the_agent(node):
    for step in range(1, WARMUP_STEPS + 8):
        with reporter.step(step) as s:
            time.sleep(0.004)
            with s.section("sync"):
                time.sleep(0.008)
            s.report(loss=2.0, tokens=100)
        time.sleep(0.003)  # between steps: counts as busy (the peers would wait), not as wait
    wait_for(lambda: node.steps().get(3) == WARMUP_STEPS + 7, 5, "the last step to arrive")
    summary, events = published(node)
    r = summary["ranks"]["3"]
    assert events == [] and summary["anomalies"] == []
    assert r["step_s"] >= 0.012 and 0.004 <= r["compute_s"] < r["step_s"] - 0.006  # sync kept apart
    assert 0.008 <= r["wait_s"] < r["step_s"]
    assert r["busy_s"] >= r["compute_s"] + 0.003  # the end of a step to the next's, less the wait
    assert r["tokens_per_s"] > 0
    wait_for(
        lambda: published(node)[0]["ranks"]["3"]["beat_age"] < reporter.HEARTBEAT_S * 1.5,
        5,
        "the background heartbeat",
    )


def test_phase_and_warm_up_steps_are_not_timed(node):
    for step in range(1, WARMUP_STEPS + 3):
        with reporter.step(step):
            if step == WARMUP_STEPS + 1:
                with reporter.phase("checkpoint"):
                    time.sleep(0.05)
    wait_for(lambda: node.steps().get(3) == WARMUP_STEPS + 2, 5, "the steps to arrive")
    assert (
        len(node.ranks[3].durations) == 1
    )  # the warm-up steps and the checkpoint step are left out
    assert node.ranks[3].durations[0] < 0.05


def test_fast_steps_go_out_together_in_order_and_a_nan_at_once(node, monkeypatch):
    """Step datagrams wait to go out together (the first send after compute is the costly one),
    then all arrive, in order, with their own times; a NaN loss and any other datagram send the
    waiting steps at once."""
    monkeypatch.setattr(reporter, "BATCH_S", 60.0)
    monkeypatch.setattr(reporter, "SLOW_STEP_S", 60.0)
    monkeypatch.setattr(reporter, "BATCH_STEPS", 100)
    monkeypatch.setattr(reporter, "HEARTBEAT_S", 60.0)  # the heartbeat would send them too
    for step in range(1, WARMUP_STEPS + 3):  # a burst within the agent's receive queue
        with reporter.step(step):
            time.sleep(0.002)
    channel = reporter._channel
    assert channel is not None
    # The first went at once (nothing was sent for BATCH_S before it), the others wait.
    assert [values["step"] for _, values in channel.pending] == list(range(2, WARMUP_STEPS + 3))
    wait_for(lambda: node.steps().get(3) == 1, 5, "the first step to arrive")
    channel.tell_phase("beat")  # any other datagram goes after the steps waiting
    assert channel.pending == []
    wait_for(lambda: node.steps().get(3) == WARMUP_STEPS + 2, 5, "the waiting steps to arrive")
    busies = node.ranks[3].busies  # from each step's own end time, not the time they were sent
    assert len(busies) == 2 and min(busies) >= 0.002
    reporter.report(WARMUP_STEPS + 3, loss=2.0)
    assert len(channel.pending) == 1
    reporter.report(WARMUP_STEPS + 4, loss=float("nan"))
    assert channel.pending == []
    wait_for(lambda: node.due(time.monotonic()) and node._pending, 5, "the NaN anomaly")


def count_sent(monkeypatch) -> list[str]:
    """The kinds of datagram this test's reporter channel sends, in order, as they go."""
    kinds: list[str] = []
    send = reporter._Channel.send

    def counted(self, kind, /, **values):
        if self is reporter._channel:  # earlier tests' channels beat on in their threads
            kinds.append(kind)
        send(self, kind, **values)

    monkeypatch.setattr(reporter._Channel, "send", counted)
    return kinds


def test_a_short_phase_sends_nothing_and_a_long_one_is_told_its_end_and_next_step_at_once(
    node, monkeypatch
):
    """A phase shorter than PHASE_TOLD_AFTER_S (a checkpoint's memory copy) costs no datagram:
    the step it fell in names it. A longer one is told by the sender thread; its end is told at
    once, and the first step after it goes at once (the agent waited long for one)."""
    monkeypatch.setattr(reporter, "HEARTBEAT_S", 60.0)  # no heartbeat tells the phase instead
    kinds = count_sent(monkeypatch)
    for step in range(1, WARMUP_STEPS + 3):
        with reporter.step(step):
            if step == WARMUP_STEPS + 1:
                with reporter.phase("checkpoint"):
                    pass
    wait_for(lambda: node.steps().get(3) == WARMUP_STEPS + 2, 5, "the steps to arrive")
    assert "phase" not in kinds and node.ranks[3].phase is None
    assert len(node.ranks[3].durations) == 1  # the step of the short phase is not timed
    with reporter.phase("eval"):
        wait_for(lambda: node.ranks[3].phase == "eval", 5, "the long phase to be told")
        assert kinds.count("phase") == 1
    assert kinds.count("phase") == 2  # its end, at once
    wait_for(lambda: node.ranks[3].phase is None, 5, "the end of the phase to arrive")
    channel = reporter._channel
    assert channel is not None
    reporter.report(WARMUP_STEPS + 3)
    assert channel.pending == []


def test_a_long_phases_end_is_progress(node, monkeypatch):
    """The step age, which the hang rule measures, counts from the end of a phase the agent was
    told of, not from the step before it: a 5 s evaluation that ends is not 5 s without
    progress (at the job's end, no step follows it)."""
    monkeypatch.setattr(reporter, "HEARTBEAT_S", 60.0)
    for step in range(1, 4):
        with reporter.step(step):
            pass
    wait_for(lambda: node.steps().get(3) == 3, 5, "the steps to arrive")
    with reporter.phase("eval"):
        wait_for(lambda: node.ranks[3].phase == "eval", 5, "the long phase to be told")
        time.sleep(0.5)  # the phase lasts: the step age grows (nothing else to wait for)
        assert published(node)[0]["ranks"]["3"]["step_age"] >= 0.5
    wait_for(lambda: node.ranks[3].phase is None, 5, "the end of the phase to arrive")
    assert published(node)[0]["ranks"]["3"]["step_age"] < 0.4


def test_steps_going_out_are_the_ranks_heartbeat_and_a_stuck_rank_beats_alone(node, monkeypatch):
    """Any datagram tells the agent the rank lives: while steps go out no heartbeat is sent
    besides them; once steps stop (stuck in one) the heartbeat goes every HEARTBEAT_S."""
    monkeypatch.setattr(reporter, "BATCH_S", 0.1)
    monkeypatch.setattr(reporter, "HEARTBEAT_S", 0.5)
    kinds = count_sent(monkeypatch)
    work = threading.Event()  # never set: each wait is a step's compute, or the stuck step
    for step in range(1, 41):  # 2 s of 0.05 s steps: 4 heartbeats before, alone
        with reporter.step(step):
            work.wait(0.05)
    stepping = kinds.count("beat")
    assert stepping <= 2, kinds  # the first (nothing sent yet), and one for a late batch
    wait_for(lambda: node.steps().get(3) == 40, 5, "every step to arrive")
    with reporter.step(41):  # stuck in this step
        wait_for(lambda: kinds.count("beat") >= stepping + 2, 10, "heartbeats while stuck")


def test_a_batch_too_long_for_one_datagram_goes_in_parts(node, monkeypatch):
    monkeypatch.setattr(reporter, "BATCH_S", 60.0)
    monkeypatch.setattr(reporter, "SLOW_STEP_S", 60.0)
    monkeypatch.setattr(reporter, "HEARTBEAT_S", 60.0)
    metrics = {f"metric_with_a_long_name_{i:02}": 1.0 / 3 for i in range(16)}
    monkeypatch.setattr(reporter, "BATCH_STEPS", 32)
    records = [(1.7e9 + step, {"step": step, **metrics}) for step in range(2, 34)]
    assert len(datagram.encode_steps(3, 0, records)) > datagram.MAX_BYTES
    for step in range(1, 34):  # the first goes at once, the 32 others when the 32nd waits
        reporter.report(step, **metrics)
    wait_for(lambda: node.steps().get(3) == 33, 5, "the last step to arrive")
    counters = node.counters()
    assert counters["accepted"] >= 3 and counters["oversize"] == 0


def test_nan_loss_is_an_anomaly_at_once(node):
    reporter.report(7, loss=2.0)
    reporter.report(8, loss=float("nan"))
    wait_for(lambda: node.due(time.monotonic()) and node._pending, 5, "the NaN anomaly")
    summary, events = published(node)
    assert (
        [e["type"] for e in events] == ["nan"]
        and events[0]["step"] == 8
        and events[0]["ranks"] == [3]
    )
    assert events[0]["kind"] == "anomaly" and summary["anomalies"][0]["id"] == events[0]["id"]


def test_scheduled_nan_and_slow_faults_fire_once_in_the_worker(node, monkeypatch):
    faults = [
        {"id": "f0", "type": "nan", "step": 4, "rank": 3},
        {"id": "f1", "type": "slow", "step": 6, "rank": 3, "factor": 3.0},
        {"id": "f2", "type": "nan", "step": 1, "rank": 0},
    ]  # another rank's: never fires here
    monkeypatch.setenv(env.FAULTS, json.dumps(faults))
    losses, computes = {}, {}
    for step in range(1, 9):
        with reporter.step(step) as s:
            t0 = time.perf_counter()
            loss = s.inject(torch.tensor(1.5))
            time.sleep(0.01)
            with s.section("sync"):
                computes[step] = time.perf_counter() - t0
            losses[step] = loss.item()
    assert [s for s, v in losses.items() if math.isnan(v)] == [4]
    assert computes[7] > 2.5 * 0.01 and computes[5] < 2 * 0.01 + 0.005
    fired = wait_for(
        lambda: len(node.fired_faults) == 2 and node.take_fired_faults(), 5, "two fired faults"
    )
    assert sorted((f["id"], step) for f, rank, step, _ in fired) == [("f0", 4), ("f1", 6)]


def test_a_fault_with_a_once_file_fires_in_one_worker_only(node, monkeypatch, tmp_path):
    """A worker restarted with the same TRANSOM_FAULTS (torchrun) must not fire the fault again."""
    once = tmp_path / "f0.fired"
    monkeypatch.setenv(
        env.FAULTS,
        json.dumps([{"id": "f0", "type": "nan", "step": 2, "rank": 3, "once_file": str(once)}]),
    )
    nan_steps = []
    for restart in range(2):
        monkeypatch.setattr(reporter, "_channel", None)  # a new worker process, same environment
        for step in range(1, 4):
            with reporter.step(step) as s:
                if math.isnan(s.inject(torch.tensor(1.0)).item()):
                    nan_steps.append((restart, step))
    assert nan_steps == [(0, 2)]
    assert once.exists()


def test_log_lines_and_gpu_counters_are_scanned(node, tmp_path):
    log = tmp_path / "rank3.log"
    log.write_text("step 1 loss 2.0\n")
    node.check({}, {3: log})
    with open(log, "a") as f:
        f.write(DEFAULT_LOG_LINE + "\nTraceback (most recent call last):\n")
    node.nvml.gpus[0]["ecc_uncorrected"] = 2
    node._hardware_at = 0.0
    node.check({}, {3: log})
    _, events = published(node)
    found = {(e["type"], e["hardware"]) for e in events}
    assert found == {("xid", True), ("ecc", True)}  # the traceback line is info: no anomaly event
    node.check({}, {3: log})
    assert published(node)[1] == []  # each line is read once


def test_time_the_agent_paused_the_workers_is_not_counted_against_them(node):
    with reporter.step(1) as s:
        s.report(loss=2.0, tokens=100)
    wait_for(lambda: node.steps().get(3) == 1, 5, "the step to arrive")
    track = node.ranks[3]
    step_at = track.step_at
    assert step_at is not None
    node.excuse(30.0)  # the agent held the workers paused (SIGSTOP) for 30 s
    # (the heartbeat's time moves the same way, but the background heartbeat may renew it)
    assert track.step_at == step_at + 30.0


def test_fast_steps_go_out_once_the_oldest_waited_the_batch_period(node, monkeypatch):
    """The sender thread wakes every ROUND_S (its late wakes are the stopped time) but sends a
    fast job's steps only once the oldest waited BATCH_S: each datagram wakes the agent."""
    monkeypatch.setattr(reporter, "HEARTBEAT_S", 60.0)  # only steps go out
    batches: list[int] = []
    send_batch = reporter._Channel._send_batch

    def counted(self, records):
        if self is reporter._channel:
            batches.append(len(records))
        send_batch(self, records)

    monkeypatch.setattr(reporter._Channel, "_send_batch", counted)
    work = threading.Event()  # never set: each wait is a step's compute
    started = time.monotonic()
    for step in range(1, 61):
        reporter.report(step)
        work.wait(0.01)
    wait_for(lambda: node.steps().get(3) == 60, 5, "every step to arrive")
    elapsed = time.monotonic() - started
    assert sum(batches) == 60
    assert len(batches) <= elapsed / (reporter.BATCH_S - reporter.ROUND_S / 2) + 2, batches
    assert len(batches) < 60 / 4  # several steps a datagram


def test_news_wakes_the_agents_loop_and_steps_that_are_not_news_do_not(node, monkeypatch):
    """The listener wakes the agent's loop for what the agent must publish now (a NaN's anomaly
    here); steps that make no summary due wake nothing: the agent's loop may tick slowly."""
    monkeypatch.setattr(node_module, "SUMMARY_MIN_PERIOD_S", 60.0)  # no steps due once published
    woken = threading.Event()
    node.wake = woken.set
    for step in range(1, 4):
        reporter.report(step, loss=2.0)
    wait_for(lambda: node.steps().get(3) == 3, 5, "the first steps")
    node.collect()  # the agent published them
    woken.clear()
    reporter.report(4, loss=2.0)
    reporter._channel.flush()  # type: ignore[union-attr]
    wait_for(lambda: node.steps().get(3) == 4, 5, "the next step")
    assert not woken.is_set()
    reporter.report(5, loss=float("nan"))  # goes at once
    assert woken.wait(5)
    assert [a.type for a in node._pending] == ["nan"]
