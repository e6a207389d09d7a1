"""End to end: a shortened `transom demo` (all five faults) and the content of its report."""

from __future__ import annotations

import json

import pytest

from transom.demo import CAMPAIGN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DEMO_TEST_STEPS = 320


def test_demo_detects_and_recovers_every_fault_and_ends_bit_identical(start_job):
    job = start_job("--steps", DEMO_TEST_STEPS, command="demo")
    code = job.wait(timeout=540)
    assert code == 0, job.output[-3000:]

    report = json.loads((job.run_dir / "report.json").read_text())
    assert report["outcome"]["state"] == "SUCCEEDED"
    faults = report["faults"]
    assert sorted(f["type"] for f in faults) == sorted(kind for kind, _, _ in CAMPAIGN)
    for fault in faults:
        assert fault["status"] == "detected+recovered", fault
        assert fault["detection_s"] is not None and fault["detection_s"] >= 0, fault
        assert fault["recovery_s"] is not None and fault["recovery_s"] > 0, fault
    assert report["weights"]["identical"] is True, report["weights"]
    goodput = report["goodput"]
    assert goodput["steps_completed"] == DEMO_TEST_STEPS
    assert 0 < goodput["effective_ratio_x"] < 1
    assert goodput["reference_wall_s"] > 0
    for name in ("report.png", "report.md", "report.json"):
        assert (job.run_dir / name).stat().st_size > 0
    assert (job.run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (job.run_dir / "report.md").read_text()
    assert "bit-identical" in markdown.lower()
    assert "all 5 injected faults" in job.output or "5/5" in job.output or "5 of 5" in job.output, (
        job.output[-2000:]
    )
