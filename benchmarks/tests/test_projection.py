"""The projection's arithmetic (benchmarks/projection.py): traces, the simulation, the inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import projection as pj

DAYS = 1.0


def system(**changes) -> pj.System:
    base = dict(
        name="s",
        detect_s={k: 1.0 for k in (pj.SOFTWARE, pj.HARDWARE, pj.HANG)},
        restart_s={k: 2.0 for k in (pj.SOFTWARE, pj.HARDWARE, pj.HANG)},
        reload_s={k: 3.0 for k in (pj.SOFTWARE, pj.HARDWARE, pj.HANG)},
        save_block_s=10.0,
        step_rate_x=1.0,
        startup_s=0.0,
        ckpt_interval_s=90.0,
    )
    return pj.System(**(base | changes))


CLUSTER = pj.Cluster(days=DAYS, pg_init_s=4.0)  # recovery = 1 + 2 + 4 + 3 = 10 s
END = DAYS * pj.DAY_S


def test_no_failure_costs_only_saves_startup_and_slower_steps():
    r = pj.simulate(system(startup_s=100.0, step_rate_x=0.5), CLUSTER, [])
    trained = END - 100.0
    cycles = trained // 100.0
    compute = cycles * 90.0 + (trained - cycles * 100.0)
    assert r["ettr"] == pytest.approx(compute * 0.5 / END)
    assert r["lost_s"]["saves"] == pytest.approx(cycles * 10.0)


def test_a_failure_loses_the_work_since_the_last_checkpoint_and_a_recovery():
    # fails 50 s after the 3rd checkpoint completed (3 cycles of 100 s)
    r = pj.simulate(system(), CLUSTER, [(350.0, pj.SOFTWARE)])
    assert r["lost_s"]["lost_work"] == pytest.approx(50.0)
    assert r["lost_s"]["recovery"] == pytest.approx(10.0)
    # 270 s kept before; from 360 s on, 860 full cycles and 40 s of the next
    assert r["useful_s"] == pytest.approx(270.0 + 860 * 90.0 + 40.0)


def test_a_failure_during_recovery_starts_the_recovery_again():
    r = pj.simulate(system(), CLUSTER, [(350.0, pj.SOFTWARE), (355.0, pj.HARDWARE)])
    assert r["lost_s"]["recovery"] == pytest.approx(5.0 + 10.0)  # half of one, all of the next
    assert r["lost_s"]["lost_work"] == pytest.approx(50.0)


def test_traces_are_seeded_and_follow_the_published_rate():
    cluster = pj.Cluster(days=300.0)
    a, b = pj.failure_trace(cluster, 7), pj.failure_trace(cluster, 7)
    assert a == b and a != pj.failure_trace(cluster, 8)
    expected = 300 * 24 / pj.mttf_h(cluster)
    assert abs(len(a) - expected) < 4 * expected**0.5
    hardware = sum(kind != pj.SOFTWARE for _, kind in a) / len(a)
    assert hardware == pytest.approx(0.78, abs=0.05)


def test_mttf_scales_inversely_with_gpus():
    assert pj.mttf_h(pj.Cluster(nodes=128, rate_source="meta")) == pytest.approx(7.9)
    assert pj.mttf_h(pj.Cluster(nodes=2048)) == pytest.approx(54 * 24 / 419)


def test_daly_interval():
    assert pj.daly_interval_s(2.0, 3600.0, 5.0) == pytest.approx(120.0)
    assert pj.daly_interval_s(0.001, 10.0, 5.0) == 5.0


def test_measured_costs_replace_the_readme_defaults(tmp_path: Path):
    row = {"detection_s": 0.5, "restart_s": 1.5, "reload_s": 0.25, "first_step_s": 0.1}
    recovery = {
        "transom_worker_crash": row,
        "transom_node_death": row | {"detection_s": 2.0},
        "torchrun_worker_crash": row | {"detection_s": None, "restart_s": 9.0},
    }
    path = tmp_path / "recovery.json"
    path.write_text("a table\n" + json.dumps(recovery) + "\n")
    overhead = tmp_path / "overhead.json"
    overhead.write_text(json.dumps({"step_rate_x": 0.97, "startup_delta_s": 1.0}))
    costs = pj.measured_costs([path, overhead])
    assert costs["node_detect_s"][0] == 2.0 and costs["torchrun_restart_s"][0] == 9.0
    assert costs["step_rate_x"][0] == 0.97
    assert costs["hang_detect_s"] == pj.README_DEFAULTS["hang_detect_s"]


def test_projection_is_deterministic_and_lists_its_assumptions():
    costs = pj.measured_costs([])
    a = pj.project(pj.Cluster(days=3.0), costs, seed=1, traces=3)
    assert a == pj.project(pj.Cluster(days=3.0), costs, seed=1, traces=3)
    for s in a["systems"].values():
        assert 0.0 < s["ettr_mean"] < 1.0
    lines = pj.assumptions(pj.Cluster(), costs)
    assert any("ASSUMPTION" in line for line in lines)
    assert all(any(k in line for line in lines) for k in costs)
