"""benchmarks/fingerprint_cost.py: a fingerprinted segment hashes and sends on the due steps
only, and a short run reports every interval with its interval and predicted cost."""

from __future__ import annotations

import time

from benchmarks import fingerprint_cost as fc


def test_a_segment_sends_one_fingerprint_a_due_step(tmp_path):
    """And keeps the replica evidence of each (transom.monitor.evidence), as the hook does."""
    _, optimizer, train = fc.make_trainer("cpu")
    listener = fc.Listener()
    try:
        train(0)
        fc.segment(fc.WARMUP + 5, 1, train, optimizer, 5, listener, tmp_path)
        # steps 1-15: the segment's first step, then 5, 10 and 15
        deadline = time.monotonic() + 10
        while listener.received < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.received == 4
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            f"local0.step{s}.bin" for s in (1, 10, 15, 5)
        ]
        fc.segment(fc.WARMUP + 5, 16, train, optimizer, 0, listener, tmp_path)  # never
        listener.send(0, "end")  # datagrams arrive in order: after this one, nothing is missing
        deadline = time.monotonic() + 10
        while listener.received < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.received == 5
    finally:
        listener.close()


def test_a_short_run_reports_each_interval():
    result = fc.run(rounds=2, steps=fc.WARMUP + 2, intervals=[3, 1], device="cpu")
    assert set(result["intervals"]) == {"3", "1"} and len(result["rows"]) == 2
    for r in result["intervals"].values():
        low, high = r["step_rate_x_ci95"]
        assert 0 < low <= r["step_rate_x"] <= high
        assert r["predicted_cost"] > 0
    every_step = result["intervals"]["1"]["predicted_cost"]
    assert every_step == result["fingerprint_ms"] / result["step_ms"]
    assert result["parameter_bytes"] == 4 * result["parameters"]
