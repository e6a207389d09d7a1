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
from transom.monitor import auto, fingerprint
from transom.monitor.replicas import ReplicaDetector, Split


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
    assert fingerprint.configured() == 25
    assert [s for s in range(7, 80) if fingerprint.due(s, 25, first=s == 7)] == [7, 25, 50, 75]
    monkeypatch.setenv("TRANSOM_FINGERPRINT_EVERY", "0")
    assert not fingerprint.due(7, fingerprint.interval(fingerprint.configured(), 0.01), True)
    monkeypatch.setenv("TRANSOM_FINGERPRINT_EVERY", "often")
    assert fingerprint.configured() is None
    monkeypatch.delenv("TRANSOM_FINGERPRINT_EVERY")
    assert fingerprint.configured() is None


def test_the_default_interval_doubles_until_its_steps_take_the_minimum_period():
    assert fingerprint.interval(None, None) == fingerprint.DEFAULT_EVERY == 50
    assert fingerprint.interval(None, 1.0) == 50  # 50 s: a real job's steps
    assert fingerprint.interval(None, 0.03) == 400  # 12 s, where 200 steps take 6 s
    assert fingerprint.interval(None, 1e-6) == fingerprint.MAX_EVERY
    assert fingerprint.interval(5, 0.001) == 5  # a configured interval is kept as it is


def due_steps(counter: auto.StepCounter, step_s: float | None, steps: range) -> list[int]:
    counter.fingerprinted = None
    counter.periods.clear()
    if step_s is not None:
        counter.periods.extend([step_s] * auto.PERIODS_KEPT)
    due = []
    for step in steps:
        if counter.fingerprint_due(step):
            due.append(step)
            counter.fingerprinted = step
    return due


def test_ranks_whose_step_times_straddle_a_doubling_still_fingerprint_common_steps(monkeypatch):
    monkeypatch.delenv("TRANSOM_FINGERPRINT_EVERY", raising=False)
    counter = auto.StepCounter()
    steps = range(3, 2000)
    unknown = due_steps(counter, None, steps)  # a generation's first steps: not timed yet
    assert unknown[:3] == [3, 50, 100]
    faster = due_steps(counter, 0.0399, steps)  # 200 steps take 7.98 s: every 400
    slower = due_steps(counter, 0.0401, steps)  # 200 steps take 8.02 s: every 200
    assert faster == [3, 400, 800, 1200, 1600]
    assert slower == [3, 200, 400, 600, 800, 1000, 1200, 1400, 1600, 1800]
    assert set(faster) <= set(slower) <= set(unknown)
    monkeypatch.setenv("TRANSOM_FINGERPRINT_EVERY", "7")
    assert due_steps(auto.StepCounter(), 0.001, range(3, 30)) == [3, 7, 14, 21, 28]


def test_the_corrupt_fault_takes_its_bits():
    (fault,) = parse_schedule("corrupt@step=30:rank=1:bits=4", 2)
    assert fault.type == "corrupt" and fault.factor == 4
    for bad in ("corrupt@step=3:bits=0", "slow@step=3:bits=2", "corrupt@step=3:bits=2:factor=2"):
        with pytest.raises(ConfigError):
            parse_schedule(bad, 2)


# -- 2 replicas: the replay of the split step tells them apart ----------------------------------


def _split(detector: ReplicaDetector):
    """Two replicas that agreed at step 10 and split at step 20 (node0: a, node1: b)."""
    assert detector.update(views({10: "s"}, {10: "s"})) is None
    found = detector.update(views({20: "a"}, {20: "b"}))
    assert found is not None and found.nodes == [] and found.severity is Severity.CRITICAL
    split = Split.of(found)
    assert split == Split(20, {"node0": "a", "node1": "b"}, agreed=10)
    return split


def test_a_replay_that_agrees_names_the_replica_that_was_wrong_and_asks_for_nothing():
    """node0's digest was the replay's: the flip had not reached it yet (it struck at the
    fingerprinted step itself)."""
    split = _split(ReplicaDetector())
    replay = ReplicaDetector(split)
    assert replay.update(views({11: "s2"}, {11: "s2"})) is None  # the replay's first step
    found = replay.update(views({20: "a"}, {20: "a"}))  # node1 computes node0's numbers now
    assert found is not None and found.severity is Severity.INFO and found.type == "sdc"
    assert found.nodes == ["node1"] and found.ranks == [1] and found.step == 20
    assert "transient" in found.message
    assert on_anomaly(found, ["node0", "node1"], 1, 2, [11], []).kind == "none"
    assert replay.update(views({30: "c"}, {30: "c"})) is None and replay.agreed == 30


def test_a_replay_that_agrees_with_neither_digest_is_transient_and_names_nobody():
    """A step after the flip the all-reduce had carried it into node0's update too."""
    replay = ReplicaDetector(_split(ReplicaDetector()))
    replay.update(views({10: "s"}, {10: "s"}))
    found = replay.update(views({20: "c"}, {20: "c"}))
    assert found is not None and found.severity is Severity.INFO
    assert found.nodes == [] and found.ranks == [] and "no node to name" in found.message
    assert found.evidence["split"] == {"node0": "a", "node1": "b"}
    assert found.evidence["replay"] == {"node0": "c", "node1": "c"}


def test_a_replica_wrong_again_in_the_replay_is_named_and_evicted():
    replay = ReplicaDetector(_split(ReplicaDetector()))
    replay.update(views({10: "s"}, {10: "s"}))  # restored 10 (before 11): its first step agrees
    found = replay.update(views({20: "a"}, {20: "c"}))  # node0 reproduces a; node1: b, then c
    assert found is not None and found.severity is Severity.CRITICAL
    assert found.nodes == ["node1"] and found.ranks == [1] and "persistent" in found.message
    action = on_anomaly(found, ["node0", "node1"], 1, 2, [11], [])
    assert action.kind == "rollback" and list(action.evict) == ["node1"]
    # no spare: rolling back to the same point again with the node kept would not help
    assert on_anomaly(found, ["node0", "node1"], 0, 2, [11], []).kind == "fail"


def test_a_replay_that_reproduces_both_digests_cannot_tell_and_raises_as_before():
    replay = ReplicaDetector(_split(ReplicaDetector()))
    replay.update(views({11: "s"}, {11: "s"}))
    found = replay.update(views({20: "a"}, {20: "b"}))  # each computes its own numbers again
    assert found is not None and found.nodes == [] and found.severity is Severity.CRITICAL
    assert Split.of(found) is not None  # and a further rollback would replay it again


def test_a_generation_that_resumed_past_the_agreeing_step_is_no_replay():
    """A script that resumes from its own newest checkpoint (saved after the split, by the
    corrupted rank 0) may skip the rollback: its step 20 holds node0's numbers on both ranks,
    which must not name node1."""
    replay = ReplicaDetector(_split(ReplicaDetector()))
    assert replay.update(views({20: "a"}, {20: "a"})) is None  # resumed at 20: its first step
    assert replay.split is None and replay.agreed == 20


def test_only_a_split_without_a_majority_is_kept_for_a_replay():
    detector = ReplicaDetector()
    detector.update(views({0: "a"}, {0: "a"}, {0: "a"}))
    named = detector.update(views({5: "a"}, {5: "a"}, {5: "x"}))
    assert named is not None and named.nodes == ["node2"] and Split.of(named) is None


def test_the_controller_hands_a_split_to_the_next_generations_detector():
    from test_decisions import T0, kinds, nodes, run, running, spec, statuses

    from transom.common.records import MonitorSummary, RankSummary
    from transom.common.states import NodeState
    from transom.control.tick import Snapshot

    def summaries(generation: int, t: float, fps: dict[str, dict[int, str]]) -> dict:
        return {
            node: MonitorSummary(
                node,
                generation,
                t,
                ranks={str(rank): RankSummary(step=max(fps[node]), fingerprints=_keys(fps[node]))},
            )
            for rank, node in enumerate(fps)
        }

    s = spec()
    members = ["node0", "node1"]
    job = running(members, s)
    live, up = nodes(*members), statuses(1, NodeState.RUNNING, *members)
    agreed = summaries(1, T0 + 1, {"node0": {10: "s"}, "node1": {10: "s"}})
    d = run(job, Snapshot(live, up, agreed), s, T0 + 1)
    split = summaries(1, T0 + 2, {"node0": {20: "a"}, "node1": {20: "b"}})
    d = run(d.job, Snapshot(live, up, split), s, T0 + 2, d.memory)
    assert kinds(d) == ["anomaly", "decision", "rollback", "incident"]
    assert d.memory.sdc_split == Split(20, {"node0": "a", "node1": "b"}, agreed=10)
    d = run(d.job, Snapshot(live, up, split, restore_step=10), s, T0 + 2.1, d.memory)
    assert d.job.generation == 2
    up2 = statuses(2, NodeState.RUNNING, *members)
    replay = summaries(2, T0 + 5, {"node0": {11: "s", 20: "a"}, "node1": {11: "s", 20: "a"}})
    d = run(d.job, Snapshot(live, up2, replay), s, T0 + 5, d.memory)
    (anomaly,) = d.anomalies
    assert anomaly.severity is Severity.INFO and anomaly.nodes == ["node1"]
    assert "decision" not in kinds(d) and d.job.generation == 2  # reported, nothing to act on
    assert d.memory.sdc_split is None  # generation 2's detector had it


def _keys(fps: dict[int, str]) -> dict[str, str]:
    return {str(step): digest for step, digest in fps.items()}
