"""The demo's campaign, and end to end: a shortened `transom demo` (all six faults, the silent
bit flip among them) and the content of its report."""

from __future__ import annotations

import json

import pytest

from transom.demo import CAMPAIGN, DEMO_FINGERPRINT_EVERY, DEMO_NODES, DEMO_STEPS, campaign
from transom.faults import parse_schedule

DEMO_TEST_STEPS = 320


def test_the_campaign_has_one_fault_of_each_kind_and_a_silent_corruption_among_them():
    faults = parse_schedule(campaign(DEMO_STEPS), DEMO_NODES, 0)
    assert [f.type for f in faults] == ["crash", "kill", "hang", "corrupt", "nan", "slow"]
    steps = [f.step for f in faults]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    corrupt = next(f for f in faults if f.type == "corrupt")
    assert corrupt.factor >= 1  # bits flipped


@pytest.mark.slow
@pytest.mark.timeout(600)
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
    (corrupt,) = [f for f in faults if f["type"] == "corrupt"]
    assert corrupt["detected_by"] == "sdc anomaly", corrupt
    # found by the next fingerprint (DEMO_FINGERPRINT_EVERY steps; the fingerprint's step counts
    # the optimizer's steps from 0, the fault's the script's from 1)
    assert 0 <= corrupt["detected_step"] + 1 - corrupt["step"] <= DEMO_FINGERPRINT_EVERY, corrupt
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
    assert f"{len(CAMPAIGN)} of {len(CAMPAIGN)} detected and recovered" in job.output, job.output[
        -2000:
    ]
