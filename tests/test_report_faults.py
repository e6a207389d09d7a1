"""The report credits each injected fault to what the fault table (transom.faults.DETECTORS) says
detects it: hand-made records, exact numbers (the helpers are test_report.py's)."""

from __future__ import annotations

import pytest
from test_report import T0, ev, write_lines

from transom.report import build_summary, read_run
from transom.report.analysis import RECOVERED


def test_a_log_fault_is_credited_to_the_hardware_anomaly_it_raised(tmp_path):
    """The log scanner's anomaly types are the patterns' (xid, ecc, ...), never "log"."""
    events = [
        ev(0.0, "generation", generation=1, members=["n0", "n1"], spares=["n2"], restore_step=None),
        ev(1.0, "running", generation=1),
        ev(5.0, "fault", fault="log", generation=1, id="f0", node="n1", rank=1, step=40),
        ev(5.5, "anomaly", observed=T0 + 5.2, id="x", type="xid", nodes=["n1"], ranks=[1]),
        ev(5.6, "decision", "evict", action="evict", anomaly="x", anomaly_type="xid", nodes=["n1"]),
        ev(6.0, "generation", generation=2, members=["n0", "n2"], spares=[], restore_step=30),
        ev(7.0, "running", generation=2),
        ev(9.0, "succeeded"),
    ]
    progress = [
        {"time": T0 + t, "generation": g, "step": step}
        for t, g, step in [(2.0, 1, 10), (5.5, 1, 42), (8.0, 2, 31), (8.5, 2, 50)]
    ]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_lines(run_dir / "events.jsonl", events)
    write_lines(run_dir / "progress.jsonl", progress)
    (log,) = build_summary(read_run(run_dir))["faults"]
    assert log["detected_by"] == "xid anomaly" and log["detection_s"] == pytest.approx(0.2)
    assert log["status"] == RECOVERED and log["recovered_at"] == T0 + 8.0


def test_a_slow_preflight_fault_is_credited_to_the_exclusion_before_training(tmp_path):
    events = [
        ev(0.5, "fault", fault="slow_preflight", generation=0, id="f0", node="n1"),
        ev(1.5, "evict", "n1 excluded before training", node="n1", preflight={"passed": True}),
        ev(2.0, "generation", generation=1, members=["n0", "n2"], spares=[], restore_step=None),
        ev(3.0, "running", generation=1),
        ev(9.0, "succeeded"),
    ]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_lines(run_dir / "events.jsonl", events)
    (fault,) = build_summary(read_run(run_dir))["faults"]
    assert fault["detected_by"] == "pre-flight exclusion" and fault["detection_s"] == 1.0
    assert fault["status"] == RECOVERED and fault["recovered_in_generation"] == 1


def _corrupt_run(tmp_path, sdc_nodes: list[str], sdc_ranks: list[int]) -> dict:
    """A corrupt fault on n1 (rank 1) at step 42, then an sdc anomaly at step 48 naming
    `sdc_nodes`, a rollback to step 40."""
    events = [
        ev(0.0, "generation", generation=1, members=["n0", "n1", "n2"], spares=["n3"]),
        ev(1.0, "running", generation=1),
        ev(5.0, "fault", fault="corrupt", generation=1, id="f0", node="n1", rank=1, step=42),
        ev(
            5.5,
            "anomaly",
            observed=T0 + 5.4,
            id="s",
            type="sdc",
            generation=1,
            step=48,  # the fingerprinted step: every rank had finished it
            nodes=sdc_nodes,
            ranks=sdc_ranks,
        ),
        ev(5.6, "decision", "rollback", action="rollback", anomaly="s", anomaly_type="sdc"),
        ev(6.0, "generation", generation=2, members=["n0", "n2", "n3"], spares=[], restore_step=40),
        ev(7.0, "running", generation=2),
        ev(9.0, "succeeded"),
    ]
    progress = [
        {"time": T0 + t, "generation": g, "step": step}
        for t, g, step in [(2.0, 1, 10), (5.5, 1, 46), (8.0, 2, 41), (8.5, 2, 50)]
    ]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_lines(run_dir / "events.jsonl", events)
    write_lines(run_dir / "progress.jsonl", progress)
    (fault,) = build_summary(read_run(run_dir))["faults"]
    return fault


@pytest.mark.parametrize("nodes, ranks", [(["n1"], [1]), ([], [])])
def test_a_corrupt_fault_is_credited_to_the_sdc_that_names_its_rank_or_none(tmp_path, nodes, ranks):
    """Named with 3 replicas or more; with 2 that split the sdc names nobody and still counts."""
    fault = _corrupt_run(tmp_path, nodes, ranks)
    assert fault["detected_by"] == "sdc anomaly" and fault["detection_s"] == pytest.approx(0.4)
    assert fault["detected_step"] == 48
    # lost: from the step every rank had finished (the sdc's, beyond the last sample's 46)
    assert fault["status"] == RECOVERED and fault["lost_steps"] == 48 - 40


def test_an_sdc_that_names_another_rank_does_not_detect_the_corrupt_fault(tmp_path):
    fault = _corrupt_run(tmp_path, ["n2"], [2])
    assert fault["detected_by"] is None and fault["status"] == "not detected"
