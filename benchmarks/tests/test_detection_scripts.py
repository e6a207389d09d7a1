"""`python -m benchmarks.detection --script ddp|hf`: the detection benchmark on plain scripts with
no Transom import (examples/ddp_unmodified.py, examples/hf_trainer_unmodified.py), which the
worker bootstrap instruments: a straggler found on the right node, the step times read from
their logs, the faults they cannot take refused."""

from __future__ import annotations

import pytest

from benchmarks import last_json, run_module
from benchmarks.detection import detection_bench as bench


def test_a_plain_script_refuses_the_faults_that_need_the_monitor_api_in_one_line(capsys):
    assert bench.main(["--script", "ddp", "--types", "hang,slow,nan"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--types nan,slow needs Transom's monitor API" in err
    assert "nan" not in bench.supported(bench.WORKLOADS["hf"])
    assert {"hang", "duty75_25", "quota"} <= set(bench.supported(bench.WORKLOADS["hf"]))


def test_step_times_and_slowdowns_read_the_plain_scripts_logs(tmp_path):
    """The Hugging Face script's lines have no loss, and its `step N` is the monitor's step + 1:
    a fault at monitor step 28 slows log steps 31 on (rank 0's log)."""
    log = tmp_path / "logs" / "g001" / "rank0.log"
    log.parent.mkdir(parents=True)
    times, t = [], 100.0
    for step in range(1, 46):
        t += 0.1 if step <= 30 else 0.3
        times.append(f"step {step} t={t:.3f}")
    log.write_text("resuming from None\n" + "\n".join(times) + "\n")
    assert bench.median_step_s([tmp_path]) == pytest.approx(0.1)
    fault = {"kind": "fault", "step": 28, "generation": 1}
    offset = bench.WORKLOADS["hf"].log_step_offset
    assert bench.slowdowns(tmp_path, [fault], offset) == [pytest.approx(3.0)]


@pytest.mark.e2e
def test_a_throttled_node_of_the_plain_ddp_script_is_named_the_straggler():
    """One 75/25 ms duty cycle on one of 2 nodes of examples/ddp_unmodified.py: the straggler is
    named on the node the fault was on, and the result says which script it measured."""
    out = run_module(
        ["benchmarks.detection", "--script", "ddp"]
        + ["--types", "duty75_25", "--nodes", "2", "--trials", "1", "--seed", "1"]
        + ["--fault-free-minutes", "0", "--overhead-rounds", "0", "--json"],
        timeout_s=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "script: ddp (examples/ddp_unmodified.py)" in out.stdout
    result = last_json(out.stdout)
    assert result["script"] == "ddp"
    row = result["transom"]["duty75_25"]
    assert row["script"] == "ddp" and row["median_step_s"], row
    (trial,) = row["trials"]
    assert trial["found"] and trial["anomaly_nodes"] == [trial["node"]], trial
    assert trial["blamed"] == [trial["node"]], trial
