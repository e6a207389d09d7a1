"""The detection benchmark's scoring (benchmarks/detection/detection_bench.py `score`) on made-up
event logs: a slowdown from outside that was not found goes on beside the next one, and a find of
its node then is not counted as the next fault's wrong node."""

from __future__ import annotations

from benchmarks.detection.detection_bench import score


def fault(t: float, node: str, step: int) -> dict:
    return {"kind": "fault", "time": t, "node": node, "step": step}


def straggler(t: float, node: str, step: int) -> list[dict]:
    return [
        {"kind": "anomaly", "type": "straggler", "time": t, "nodes": [node], "step": step},
        {"kind": "decision", "time": t + 0.01, "nodes": [node]},
    ]


def test_a_fault_fired_beside_an_earlier_unanswered_slowdown_is_scored_apart():
    events = [
        {"kind": "generation", "time": 0.0},
        fault(10.0, "node0", 30),  # never found: node0 stays slowed
        fault(20.0, "node1", 130),
        *straggler(23.0, "node0", 150),  # node0, the earlier fault's node, is named
        {"kind": "generation", "time": 23.1},
        fault(30.0, "node1", 230),  # a new generation since: a clean trial
        *straggler(32.0, "node1", 250),
    ]
    result = score("duty300_300", events, step_s=0.1)
    first, second, third = result["trials"]
    assert not first["found"] and "overlapped" not in first
    assert second["overlapped"] == ["node0"] and second["blamed"] == ["node0"]
    assert third["blamed"] == ["node1"] and "overlapped" not in third
    # Over the two clean trials: one found, on the right node; both decisions answered a fault.
    assert result["overlapped"] == 1
    assert result["recall"] == 0.5 and result["attribution"] == 1.0
    assert result["precision"] == 1.0


def test_faults_that_end_when_found_never_overlap():
    events = [fault(10.0, "node0", 30), fault(20.0, "node1", 80), *straggler(21.0, "node0", 85)]
    result = score("slow", events, step_s=0.1)
    assert result["overlapped"] == 0
    assert result["trials"][1]["blamed"] == ["node0"] and result["attribution"] == 0.0
