"""A rank's stopped time (transom.monitor.stopped_time): the worker's late wakes, the agent's
window over them, a real process stopped from outside while it waits in C, and the straggler
rule's use of it (a stop inside the collective makes no rank late by its busy time)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import wait_for

from transom.common import env
from transom.faults import MockNvml, cpu_quota
from transom.monitor import datagram, stopped_time, waiting
from transom.monitor.node import NodeMonitor
from transom.monitor.stopped_time import (
    STOPPED_MIN_S,
    STOPPED_MIN_SPAN_S,
    STOPPED_WINDOW_S,
    StopMeter,
    StoppedTime,
)


def test_only_late_wakes_outside_a_phase_count():
    meter = StopMeter()
    meter.woke(0.1 + STOPPED_MIN_S / 2, 0.1, in_phase=False)  # scheduling noise
    assert meter.total_s == 0.0
    meter.woke(0.4, 0.1, in_phase=True)  # a save holding Python's lock
    assert meter.total_s == 0.0
    meter.woke(0.4, 0.1, in_phase=False)
    assert meter.total_s == pytest.approx(0.3)


def test_run_queue_waits_count_unless_the_round_was_all_in_a_phase(monkeypatch):
    """An evaluation's run-queue waits (ranks contending for cores with no pause between their
    batches) are not a step's: a round all in a phase counts none, and its wait is not carried
    into the next round either; a round a short phase (a save) only touched counts its wait."""
    waited = iter([0.0, 0.2, 0.25, 0.45, 0.5, 0.55])  # the training thread's run-queue total
    monkeypatch.setattr(stopped_time, "run_queue_s", lambda tid: next(waited))
    meter = StopMeter(tid=1)
    meter.woke(0.1, 0.1, in_phase=True, all_in_phase=True)  # 0.2 s waited in an evaluation
    assert meter.total_s == 0.0
    meter.woke(0.1, 0.1, in_phase=False)  # 0.05 s: counted from where the phase left it
    assert meter.total_s == pytest.approx(0.05)
    meter.woke(0.1, 0.1, in_phase=True)  # 0.2 s waited in a round a save began in
    assert meter.total_s == pytest.approx(0.25)
    meter.woke(0.3, 0.1, in_phase=True)  # a late wake there counts for nothing, the wait does
    assert meter.total_s == pytest.approx(0.30)
    meter.woke(0.3, 0.1, in_phase=True, all_in_phase=True)  # neither does, all in the phase
    assert meter.total_s == pytest.approx(0.30)


def test_the_window_counts_after_warm_up_and_leaves_the_largest_out():
    stopped = StoppedTime()
    stopped.add(0.0, 5.0, counting=False)  # a generation's start: taken as the baseline only
    stopped.add(0.5, 7.0, counting=False)
    assert stopped.per_step(0.5, 0.1) is None
    t, total = 1.0, 7.0
    stopped.add(t, total, counting=True)
    for _ in range(4):  # 0.3 s stopped every 0.6 s
        t, total = t + 0.6, total + 0.3
        stopped.add(t, total, counting=True)
    assert stopped.per_step(t, 0.1) is not None  # counted for a whole window (2.4 s)
    # Within the last 2 s: 4 stops of 0.3 s (told at 1.6, 2.2, 2.8, 3.4), the largest left out.
    assert stopped.per_step(t, 0.1) == pytest.approx(0.9 / STOPPED_WINDOW_S * 0.1)
    # A slowdown that began inside the window is measured from its first stop (1 s at least):
    # two stops of 0.3 s 0.6 s apart, after a quiet window, read 0.3 s over 1 s, not over 2 s.
    began = StoppedTime()
    began.add(0.0, 0.0, counting=True)
    for t in (0.5, 1.0, 1.5, 2.0, 2.5):
        began.add(t, 0.0, counting=True)
    began.add(2.8, 0.3, counting=True)  # stopped from 2.5 to 2.8
    began.add(3.4, 0.6, counting=True)  # and from 3.1 to 3.4
    assert began.per_step(3.4, 0.1) == pytest.approx(0.3 / STOPPED_MIN_SPAN_S * 0.1)
    assert began.per_step(4.3, 0.1) == pytest.approx(0.3 / 1.8 * 0.1, abs=1e-5)  # since 2.5
    # One hiccup alone counts for nothing.
    lone = StoppedTime()
    lone.add(0.0, 0.0, counting=True)
    lone.add(0.2, 0.0, counting=True)
    lone.add(2.5, 0.5, counting=True)
    assert lone.per_step(2.5, 0.1) == 0.0


def test_what_a_datagram_claims_is_bounded_by_the_agents_own_clock():
    stopped = StoppedTime()
    stopped.add(0.0, 0.0, counting=True)
    stopped.add(1.0, 1000.0, counting=True)  # no process stops 1000 s in 1 s
    stopped.add(2.0, 2000.0, counting=True)
    stopped.add(2.5, 1.0, counting=True)  # a total that went down starts over
    stopped.add(3.0, 1.0, counting=True)
    assert [d for _, d in stopped.increments] == pytest.approx([1.1, 1.1])


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, "0.5", True, [1]])
def test_a_bad_stopped_total_is_refused(value):
    message = {"k": "beat", "rank": 0, "gen": 0, "t": time.time(), "step": 1, "stopped": value}
    verdict = datagram.parse(json.dumps(message).encode())
    assert isinstance(verdict, datagram.Rejection), verdict


def test_steps_beats_and_phases_carry_it():
    for data in (
        datagram.encode_steps(0, 0, [(time.time(), {"step": 1, "dur": 0.1})], 0.25),
        datagram.encode("beat", 0, 0, time.time(), step=1, stopped=0.25),
        datagram.encode("phase", 0, 0, time.time(), phase="eval", stopped=0.25),
    ):
        message = datagram.parse(data)
        assert isinstance(message, datagram.Message) and message.values["stopped"] == 0.25


WAITING_RANK = """
import time
from transom.monitor import reporter
assert reporter._get() is not None
print("ready", flush=True)
time.sleep(120)  # in C with Python's lock let go, as a rank waiting in a collective
"""


@pytest.mark.integration
def test_a_process_stopped_while_it_waits_in_c_is_counted_and_a_waiting_one_is_not(
    tmp_path, monkeypatch
):
    """Rank 3 is stopped 300 ms of every 600 ms from outside while its main thread waits in C
    (where its busy time would show nothing); rank 4 waits the same way, never stopped."""
    node = NodeMonitor("nodeX", nvml=MockNvml())
    node.expect_ranks([3, 4])
    procs = []
    try:
        for rank in (3, 4):
            child_env = os.environ | {
                env.MONITOR_SOCKET: str(node.socket_path),
                "RANK": str(rank),
                env.GENERATION: "0",
            }
            proc = subprocess.Popen(
                [sys.executable, "-c", WAITING_RANK],
                env=child_env,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(proc)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        wait_for(lambda: {3, 4} <= node.ranks.keys(), 10, "both ranks' first beats")
        start = {r: node.ranks[r].stopped.total for r in (3, 4)}
        stopped, cycles = procs[0], 5
        for _ in range(cycles):  # the fault itself: a duty cycle, not a wait for anything
            stopped.send_signal(signal.SIGSTOP)
            time.sleep(0.3)
            stopped.send_signal(signal.SIGCONT)
            time.sleep(0.3)
        resumed = time.monotonic()
        wait_for(
            lambda: all((node.ranks[r].beat_at or 0) > resumed for r in (3, 4)),
            10,
            "a beat from each after the last stop",
        )
        grown = {r: (node.ranks[r].stopped.total or 0) - (start[r] or 0) for r in (3, 4)}
        # Each 0.3 s stop wakes the sender (a 0.1 s round) 0.2-0.3 s late.
        assert 0.8 <= grown[3] <= cycles * 0.3 + 0.2, grown
        assert grown[4] < 0.2, grown
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)
        node.close()


SPINNING_RANK = """
from transom.monitor import reporter
assert reporter._get() is not None
print("ready", flush=True)
while True:  # computing, as a rank between its collectives
    sum(range(10_000))
"""


@pytest.mark.integration
@pytest.mark.skipif(not cpu_quota.available(), reason="no writable cpu cgroup here")
def test_a_rank_held_by_a_cpu_quota_is_counted_by_its_run_queue_wait():
    """Rank 3 computes under a cgroup quota of a fifth of a CPU (held 80 ms of each 100 ms
    period, a rhythm the sender's 0.1 s round can lock onto); rank 4 waits in C, as a rank in a
    collective, and waits on no run queue."""
    node = NodeMonitor("nodeX", nvml=MockNvml())
    node.expect_ranks([3, 4])
    procs, group = [], None
    try:
        for rank, script in ((3, SPINNING_RANK), (4, WAITING_RANK)):
            child_env = os.environ | {
                env.MONITOR_SOCKET: str(node.socket_path),
                "RANK": str(rank),
                env.GENERATION: "0",
            }
            proc = subprocess.Popen(
                [sys.executable, "-c", script], env=child_env, stdout=subprocess.PIPE, text=True
            )
            procs.append(proc)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        wait_for(lambda: {3, 4} <= node.ranks.keys(), 10, "both ranks' first beats")
        start = {r: node.ranks[r].stopped.total or 0.0 for r in (3, 4)}
        capped_at = time.monotonic()
        group = cpu_quota.limit(procs[0].pid, 0.2, f"transom-test-runq-{procs[0].pid}")
        wait_for(
            lambda: all((node.ranks[r].beat_at or 0) > capped_at + 2.0 for r in (3, 4)),
            15,
            "beats from both 2 s into the cap",
        )
        grown = {r: (node.ranks[r].stopped.total or 0.0) - start[r] for r in (3, 4)}
        assert grown[3] >= 0.8, grown  # 80% of 2 s or more, less what the round missed
        assert grown[4] < 0.2, grown
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
        node.close()
        if group is not None:
            cpu_quota.remove(group)


def test_a_rank_stopped_in_the_collective_is_the_one_waited_for():
    """Busy and compute times alike (the stop fell in the all-reduce, where both ranks waited);
    node1's process did not run for 0.04 s a step: it is the one the job waits for."""

    def view(node, rank, stopped_s):
        return {
            "node": node,
            "rank": rank,
            "compute_s": 0.05,
            "busy_s": 0.055,
            "wait_s": 0.06,
            "step_s": 0.11,
            "stall_s": 0.0,
            "stopped_s": stopped_s,
        }

    delays = waiting.node_delays([view("node0", 0, 0.0), view("node1", 1, 0.04)])
    assert delays["node1"][0] == pytest.approx(0.04) and delays["node0"][0] <= 0.0
    assert delays["node1"][2]()["stopped_s"] == 0.04
    # A node without the measure (an older worker) is compared on the others alone.
    delays = waiting.node_delays([view("node0", 0, None), view("node1", 1, 0.04)])
    assert delays["node1"][0] == pytest.approx(0.0)
