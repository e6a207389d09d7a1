"""Silent data corruption: replica fingerprints (transom.monitor.fingerprint), the controller's
comparison (transom.monitor.replicas), the policy's answer and the `corrupt` fault's bit flips."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from transom.common.records import Severity
from transom.control.policy import on_anomaly
from transom.faults import parse_schedule
from transom.faults.worker_side import flip_bits
from transom.job_spec import ConfigError
from transom.monitor import fingerprint
from transom.monitor.replicas import ReplicaDetector


def views(*fingerprints: dict) -> SimpleNamespace:
    """One rank a node (rank i on node i), each with its fingerprints by step."""
    return SimpleNamespace(
        ranks=[
            {"rank": i, "node": f"node{i}", "fingerprints": {str(s): d for s, d in fps.items()}}
            for i, fps in enumerate(fingerprints)
        ]
    )


def test_the_odd_replica_out_is_named_with_the_last_step_they_agreed_on():
    detector = ReplicaDetector()
    assert detector.update(views({0: "a"}, {0: "a"}, {0: "a"})) is None
    assert (
        detector.update(views({0: "a", 50: "b"}, {0: "a", 50: "b"}, {0: "a"})) is None
    )  # not all in
    found = detector.update(views({50: "b"}, {50: "b"}, {50: "x"}))
    assert found is not None and found.type == "sdc" and found.severity is Severity.CRITICAL
    assert found.nodes == ["node2"] and found.ranks == [2] and found.step == 50
    assert found.evidence["last_agreeing_step"] == 0
    assert detector.update(views({50: "b"}, {50: "b"}, {50: "x"})) is None  # raised once


def test_two_replicas_that_split_raise_without_naming_a_node():
    detector = ReplicaDetector()
    assert detector.update(views({10: "a"}, {10: "a"})) is None
    found = detector.update(views({20: "a"}, {20: "b"}))
    assert found is not None and found.nodes == [] and found.evidence["last_agreeing_step"] == 10


def test_ranks_that_never_agreed_are_shards_not_replicas_and_never_raise():
    detector = ReplicaDetector()  # tensor parallel: every rank holds another shard
    assert detector.update(views({0: "a"}, {0: "b"}, {0: "c"}, {0: "d"})) is None
    assert detector.update(views({50: "a"}, {50: "a"}, {50: "a"}, {50: "z"})) is None
    pairs = ReplicaDetector()  # two replicas of two shards: no strict majority either
    assert pairs.update(views({0: "a"}, {0: "a"}, {0: "b"}, {0: "b"})) is None


def test_malformed_fingerprints_from_a_summary_are_ignored():
    detector = ReplicaDetector()
    forged = SimpleNamespace(
        ranks=[
            {"rank": 0, "node": "node0", "fingerprints": {"5": "a"}},
            {"rank": 1, "node": "node1", "fingerprints": {"five": "a", "5": 7}},
            {"rank": 2, "node": "node2", "fingerprints": ["5", "a"]},
        ]
    )
    assert detector.update(forged) is None and detector.checked is None
    long = views({5: "a"}, {5: "a"}, {5: "x" * 1000})  # an overlong digest is not one
    assert detector.update(long) is None and detector.checked is None


def test_the_policy_rolls_back_before_the_agreeing_step_and_evicts_the_suspect():
    detector = ReplicaDetector()
    detector.update(views({40: "a"}, {40: "a"}, {40: "a"}))
    anomaly = detector.update(views({50: "a"}, {50: "x"}, {50: "a"}))
    assert anomaly is not None
    members = ["node0", "node1", "node2"]
    action = on_anomaly(anomaly, members, 1, 3, [], [])
    assert action.kind == "rollback" and action.rollback_before == 41  # a checkpoint <= 40
    assert list(action.evict) == ["node1"]
    kept = on_anomaly(anomaly, members, 0, 3, [], [])  # no spare, no room to shrink
    assert kept.kind == "rollback" and kept.evict == {}
    again = on_anomaly(anomaly, members, 0, 3, [41], [])  # the same point again, nothing to evict
    assert again.kind == "fail"


def test_a_bit_flip_changes_the_fingerprint_and_makes_no_nan():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    before = fingerprint.of_parameters(model.parameters())
    assert fingerprint.of_parameters(model.parameters()) == before  # the same bits, the same digest
    original = [p.detach().clone() for p in model.parameters()]
    assert flip_bits(model.parameters(), 3, seed=1) == 3
    assert fingerprint.of_parameters(model.parameters()) != before
    changed = sum(int((a != b).sum()) for a, b in zip(original, model.parameters(), strict=True))
    assert 1 <= changed <= 3
    for a, b in zip(original, model.parameters(), strict=True):
        assert torch.isfinite(b).all()
        assert torch.allclose(a, b, rtol=1e-3, atol=0)  # low mantissa bits: a tiny change


def test_fingerprints_are_taken_at_the_first_step_then_every_interval(monkeypatch):
    monkeypatch.setenv("TRANSOM_FINGERPRINT_EVERY", "25")
    assert fingerprint.every() == 25
    assert [s for s in range(7, 80) if fingerprint.due(s, 25, first=s == 7)] == [7, 25, 50, 75]
    monkeypatch.setenv("TRANSOM_FINGERPRINT_EVERY", "0")
    assert not fingerprint.due(7, fingerprint.every(), first=True)
    monkeypatch.setenv("TRANSOM_FINGERPRINT_EVERY", "often")
    assert fingerprint.every() == fingerprint.DEFAULT_EVERY


def test_the_corrupt_fault_takes_its_bits():
    (fault,) = parse_schedule("corrupt@step=30:rank=1:bits=4", 2)
    assert fault.type == "corrupt" and fault.factor == 4
    for bad in ("corrupt@step=3:bits=0", "slow@step=3:bits=2", "corrupt@step=3:bits=2:factor=2"):
        with pytest.raises(ConfigError):
            parse_schedule(bad, 2)
