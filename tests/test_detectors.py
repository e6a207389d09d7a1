"""Unit tests of the monitor's pure detectors, log patterns and the anomaly policy."""

from __future__ import annotations

import math
import random

from transom.common.records import (
    Anomaly,
    FailureReport,
    MonitorSummary,
    PreflightResult,
    RankSummary,
    Severity,
)
from transom.control.policy import on_anomaly
from transom.faults import MockNvml
from transom.job_spec import JobSpec
from transom.monitor import busy, detectors, patterns
from transom.monitor.collect import gpu_problems

MEMBERS = ["node0", "node1", "node2"]
HANG_FLOOR_S = JobSpec(script="train.py").hang_floor_s


def hang(views):
    return detectors.hang(views, HANG_FLOOR_S)


def view(node, rank, step, step_age=0.1, beat_age=0.2, phase=None, step_s=0.2, compute_s=0.1):
    return {
        "node": node,
        "rank": rank,
        "step": step,
        "step_age": step_age,
        "beat_age": beat_age,
        "phase": phase,
        "step_s": step_s,
        "compute_s": compute_s,
    }


# -- numerics -------------------------------------------------------------------------------------


def test_nan_and_inf_losses_are_anomalies_at_their_step():
    for bad in (math.nan, math.inf):
        a = detectors.numerics("node1", 4, 17, bad, [])
        assert a.type == "nan" and a.step == 17 and a.ranks == [4] and a.nodes == ["node1"]
    assert detectors.numerics("node1", 4, 17, 2.5, []) is None


def test_loss_spike_needs_a_window_and_a_large_jump():
    window = [2.0 + 0.01 * (i % 5) for i in range(30)]
    assert detectors.numerics("n", 0, 31, 2.05, window) is None
    assert detectors.numerics("n", 0, 31, 9.0, window[:5]) is None  # too few samples to judge
    spike = detectors.numerics("n", 0, 31, 9.0, window)
    assert spike.type == "loss_spike" and spike.severity == "warning"


def test_the_spike_check_skips_the_median_only_where_no_spike_can_be():
    """numerics skips median and MAD for a loss at most twice the window's smallest (>= 0): the
    verdicts are those of the full rule, on windows of positive, mixed and negative losses."""

    def full_rule(loss, window):
        m, mad = detectors.median_mad(window)
        spike_bar = m + detectors.LOSS_SPIKE_MADS * detectors.MAD_TO_SIGMA * mad
        return loss > spike_bar and loss > detectors.LOSS_SPIKE_RATIO * m

    rng = random.Random(7)
    spikes = 0
    for trial in range(3000):
        base = rng.choice([0.0, 2.0, -1.0, -5.0])
        window = [base + rng.gauss(0, rng.choice([0.01, 0.5, 2.0])) for _ in range(30)]
        loss = base + rng.choice([0.0, 1.0, 5.0, 50.0]) * rng.random()
        found = detectors.numerics("n", 0, trial, loss, window)
        assert (found is not None) == full_rule(loss, window), (loss, window)
        spikes += found is not None
    assert 50 < spikes < 2950  # both verdicts were tested, on both paths


def test_telemetry_gap_is_quick_for_a_stopped_process_and_patient_otherwise():
    assert detectors.telemetry_gap("n", 1, 3.5, "stopped").type == "telemetry_gap"
    assert detectors.telemetry_gap("n", 1, 3.5, "running") is None  # e.g. tearing down at exit
    assert detectors.telemetry_gap("n", 1, 12.0, "running") is not None


# -- hang -----------------------------------------------------------------------------------------


def test_no_hang_while_some_rank_progresses_or_before_the_timeout():
    views = [
        view("node0", 0, 50, step_age=20),
        view("node1", 1, 51, step_age=0.1),
        view("node2", 2, 50, step_age=20),
    ]
    assert hang(views) is None
    views = [view(f"node{i}", i, 50, step_age=5.0) for i in range(3)]
    assert hang(views) is None


def test_hang_blames_the_rank_whose_heartbeat_stopped():
    views = [
        view("node0", 0, 50, step_age=9),
        view("node1", 1, 50, step_age=9, beat_age=8.5),
        view("node2", 2, 50, step_age=9),
    ]
    a = hang(views)
    assert a.type == "hang" and a.nodes == ["node1"] and a.ranks == [1]
    assert a.evidence["timeout_s"] == HANG_FLOOR_S


def test_a_stopped_rank_is_a_hang_after_1_s_of_short_steps_and_nothing_else_is():
    # Quiet for 2.5 s of 0.2 s steps under an 8 s timeout: the agents have collected the stacks.
    assert detectors.suspect_after_s(HANG_FLOOR_S, [0.2]) == detectors.STOPPED_HANG_S == 1.0
    quiet = [view(f"node{i}", i, 50, step_age=2.5, beat_age=0.3) for i in range(3)]
    assert hang(quiet) is None
    for v, where in zip(quiet, ("in all_reduce at train.py:57", "stopped", None), strict=True):
        v["where"] = where
    quiet[1]["beat_age"] = 2.4
    assert hang(quiet) is None  # node2's agent has not said where its rank is yet
    quiet[2]["where"] = "in all_reduce at train.py:57"
    a = hang(quiet)
    assert a is not None and a.nodes == ["node1"] and a.evidence["timeout_s"] == HANG_FLOOR_S
    assert "rank 1: stopped" in a.message and a.evidence["why"] == "process stopped"
    running = [dict(v, where="in all_reduce at train.py:57") for v in quiet]
    assert hang(running) is None  # every rank can run: the whole timeout
    early = [dict(v, step_age=0.9) for v in quiet]
    assert hang(early) is None  # stopped, but not for 1 s (a 300 ms stop of a duty cycle)
    # Steps of 1.5 s: half of the timeout's 4 steps (3 s), and never more than half the timeout.
    assert detectors.suspect_after_s(HANG_FLOOR_S, [1.5]) == 3.0
    slow = [dict(v, step_s=1.5) for v in quiet]
    assert hang(slow) is None
    assert hang([dict(v, step_age=3.1) for v in slow]) is not None
    assert detectors.suspect_after_s(1.5, [0.2]) == 0.75  # a floor of 1.5 s: half of it
    in_phase = [dict(v, step_age=100.0, phase="checkpoint") for v in quiet]
    assert hang(in_phase) is None  # a phase: half of its own timeout (150 s)
    # A rank its agent found at work outside a step is no reason to wait for a stopped one.
    busy_peer = [dict(v, phase=busy.BUSY_PHASE if v["rank"] == 0 else None) for v in quiet]
    assert hang(busy_peer) is not None
    working = [dict(v, where="in f at t.py:3", step_age=20.0) for v in busy_peer]  # none stopped
    assert hang(working) is None  # past the 8 s timeout, but rank 0 is at work: a phase's 300 s
    assert hang([dict(v, phase=None) for v in working]) is not None


def test_hang_blames_the_laggard_when_every_heartbeat_is_alive():
    views = [
        view("node0", 0, 50, step_age=9),
        view("node1", 1, 49, step_age=9.5),
        view("node2", 2, 50, step_age=9),
    ]
    assert hang(views) is None  # every heartbeat alive: the agents' looks first
    views = [dict(v, where="in all_reduce at t.py:5") for v in views]
    assert hang(views).nodes == ["node1"]
    # ... or, where a node's places never come (no dump handler), PLACES_WAIT_S later
    assert hang([dict(v, where=None, step_age=8 + detectors.PLACES_WAIT_S) for v in views])
    same = [dict(view(f"node{i}", i, 50, step_age=9), where="in f at t.py:1") for i in range(3)]
    a = hang(same)
    assert a.nodes == [] and "collective" in a.evidence["why"]


def test_hang_timeout_is_learned_from_step_times_and_phases_are_exempt():
    slow = [view(f"node{i}", i, 50, step_age=9, step_s=3.0) for i in range(3)]
    assert hang(slow) is None  # 4 x 3 s = 12 s timeout
    checkpointing = [view("node0", 0, 50, step_age=60, phase="checkpoint")] + [
        view(f"node{i}", i, 50, step_age=60) for i in (1, 2)
    ]
    assert hang(checkpointing) is None


def test_no_hang_before_every_rank_finished_a_step():
    assert hang([view("node0", 0, None, step_age=None), view("node1", 1, 3, step_age=50)]) is None


def test_rank_views_add_the_publication_lag_to_ages():
    summaries = {
        "node0": {
            "node": "node0",
            "generation": 2,
            "t": 100.0,
            "ranks": {"0": {"step": 5, "step_age": 1.0, "beat_age": 0.5}},
        },
        "node1": {
            "node": "node1",
            "generation": 1,
            "t": 100.0,
            "ranks": {"1": {"step": 5, "step_age": 1.0, "beat_age": 0.5}},
        },
    }
    summaries = {n: MonitorSummary.from_dict(s) for n, s in summaries.items()}
    views = detectors.rank_views(summaries, 2, now=102.0)
    # A beat the agent said was beating ages only past the agents' keep-alive (it would have
    # written at once had it stopped); a step ages by the whole lag.
    assert len(views) == 1 and views[0]["step_age"] == 3.0 and views[0]["beat_age"] == 0.5
    later = 100.0 + detectors.SUMMARY_KEEPALIVE_S + 2.0
    [view] = detectors.rank_views(summaries, 2, now=later)
    assert view["step_age"] == later - 99.0 and view["beat_age"] == 2.5


def test_a_stepping_rank_ages_only_past_the_keep_alive():
    """A summary that says a rank steps (its step younger than two step times, 1 s at least)
    stands for "stepping" until the agent writes again: its step ages only past the keep-alive;
    one step older than that ages by the whole lag."""
    fast = RankSummary(step=5, step_age=0.3, beat_age=0.2, step_s=0.1)
    slow = RankSummary(step=5, step_age=5.0, beat_age=0.2, step_s=3.0)
    quiet = RankSummary(step=5, step_age=1.2, beat_age=0.2, step_s=0.1)
    assert detectors.stepping(fast) and detectors.stepping(slow) and not detectors.stepping(quiet)
    assert not detectors.stepping(RankSummary(step=5, step_age=0.3))  # no step time yet
    ranks = {"0": fast, "1": slow, "2": quiet}
    summaries = {"node0": MonitorSummary("node0", 2, 100.0, ranks)}
    lag = detectors.SUMMARY_KEEPALIVE_S + 1.0
    views = detectors.rank_views(summaries, 2, now=100.0 + lag)
    assert [v["step_age"] for v in views] == [1.3, 6.0, 1.2 + lag]


# -- logs and GPUs --------------------------------------------------------------------------------


def test_log_patterns_are_classified():
    cases = {
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.": ("xid", True),
        "RuntimeError: CUDA error: an illegal memory access was encountered": ("cuda_error", False),
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB": ("oom", False),
        "[rank3]: Traceback (most recent call last):": ("traceback", False),
        "NCCL WARN NET/IB : Got completion with error 12": ("nccl_error", False),
        "kernel: mlx5_core 0000:5e:00.0: fatal error detected": ("ib_error", True),
        "uncorrectable ECC error encountered": ("ecc", True),
    }
    for line, (type_, hardware) in cases.items():
        p = patterns.classify(line)
        assert p is not None and (p.type, p.hardware) == (type_, hardware), line
    assert patterns.classify("step 12 loss 2.3 t=1.0") is None
    assert patterns.classify("DefaultCPUAllocator: can't allocate memory").type == "oom"


def test_fake_nvml_counters_become_hardware_problems():
    nvml = MockNvml(gpus=2)
    before = nvml.read()
    assert gpu_problems(before, nvml.read()) == []
    nvml.gpus[1]["xid"] = 1
    nvml.gpus[0]["ecc_uncorrected"] = 3
    nvml.gpus[0]["throttle_reasons"] = 0x40
    found = {t: hw for t, _, hw in gpu_problems(before, nvml.read())}
    assert found == {"xid": True, "ecc": True, "gpu_throttle": False}


# -- policy ---------------------------------------------------------------------------------------


def anomaly(type_, nodes=(), step=None, hardware=False):
    return Anomaly(type_, Severity.WARNING, "m", list(nodes), step=step, hardware=hardware)


def test_policy_rolls_back_numerics_and_fails_when_they_repeat_at_the_same_step():
    a = on_anomaly(anomaly("nan", ["node1"], step=30), MEMBERS, 0, 3, [], [])
    assert a.kind == "rollback" and a.rollback_before == 30
    assert on_anomaly(anomaly("nan", ["node1"], step=30), MEMBERS, 0, 3, [30], []).kind == "fail"


def test_policy_evicts_stragglers_only_with_a_spare():
    assert on_anomaly(anomaly("straggler", ["node2"]), MEMBERS, 1, 3, [], []).evict.keys() == {
        "node2"
    }
    assert on_anomaly(anomaly("straggler", ["node2"]), MEMBERS, 0, 3, [], []).kind == "warn"


def test_policy_for_hardware_hangs_and_warnings():
    hw = on_anomaly(anomaly("xid", ["node0"], hardware=True), MEMBERS, 1, 3, [], [])
    assert hw.kind == "evict" and "hardware" in hw.evict["node0"]
    assert (
        on_anomaly(anomaly("xid", ["node0"], hardware=True), MEMBERS, 0, 2, [], []).kind == "evict"
    )  # elastic
    assert (
        on_anomaly(anomaly("xid", ["node0"], hardware=True), MEMBERS, 0, 3, [], []).kind == "warn"
    )
    assert on_anomaly(anomaly("hang", ["node1"], step=9), MEMBERS, 1, 3, [], []).kind == "evict"
    assert on_anomaly(anomaly("hang", ["node1"], step=9), MEMBERS, 0, 3, [], []).kind == "restart"
    assert on_anomaly(anomaly("hang", [], step=9), MEMBERS, 1, 3, [], []).kind == "restart"
    assert on_anomaly(anomaly("hang", [], step=9), MEMBERS, 1, 3, [], [9]).kind == "fail"
    assert on_anomaly(anomaly("crash", ["node1"]), MEMBERS, 1, 3, [], []).kind == "none"
    for kind in ("loss_spike", "throughput_drop", "telemetry_gap", "cuda_error"):
        assert on_anomaly(anomaly(kind, ["node1"]), MEMBERS, 1, 3, [], []).kind == "warn"


def test_crash_suspects_only_workers_that_failed_by_themselves():
    killed = FailureReport(
        describe="rank 1 killed by SIGKILL", time=5.0, rank=1, exitcode=-9, signal="SIGKILL"
    )
    peer = FailureReport(
        describe="rank 0 exit code 1: Connection closed by peer",
        time=5.1,
        peer_error=True,
        rank=0,
        exitcode=1,
    )
    a = detectors.crash("node1", [killed])
    assert (a.type, a.severity, a.ranks, a.time) == ("crash", "critical", [1], 5.0)
    b = detectors.crash("node0", [peer])
    assert (b.type, b.severity) == ("peer_exit", "info")


def test_preflight_outliers_are_nodes_far_below_the_median():
    from transom.control.policy import slow_outliers

    def results(**gflops: float) -> dict[str, PreflightResult]:
        return {n: PreflightResult(True, compute_gflops=g) for n, g in gflops.items()}

    assert list(slow_outliers(results(node0=50.0, node1=12.0, node2=45.0, node3=40.0))) == ["node1"]
    assert slow_outliers(results(node0=50.0, node1=12.0)) == {}
    assert slow_outliers(results(a=30.0, b=31.0, c=32.0)) == {}
