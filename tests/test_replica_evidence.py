"""Replica evidence (transom.monitor.evidence): with 2 replicas, the replay of a split step names
the replica whose parameters were corrupted, by their values where the replicas differ.

The replicas here are two copies of the demo's GPT trained in lockstep in one process, their
gradients averaged as DDP's all-reduce would; the corruption is the `corrupt` fault's bit flips,
struck in two shapes: after an optimizer step (what the fault injector does) and before a
forward pass (a flip mid-run, which the next gradient carries into both replicas' updates)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from transom.common.records import Severity
from transom.faults.worker_side import flip_bits
from transom.monitor import evidence
from transom.monitor.replicas import ReplicaDetector, Split, odd_ones_out
from transom.workloads.gpt_model import GPT, get_batch, make_corpus, make_optimizer

LAST_AGREED, SPLIT = 6, 12  # fingerprints: the replicas agreed at 6 and split at 12

_text = make_corpus()
_chars = sorted(set(_text))
DATA = torch.tensor([_chars.index(c) for c in _text[:20000]])


def replica():
    torch.manual_seed(1)
    model = GPT(len(_chars), 16, 1, 2, 16)
    return model, make_optimizer(model, 1e-3, 0.1)


def train(replicas, steps, flip: tuple[int, str, int] | None = None):
    """Train `replicas` in lockstep for `steps`; `flip` = (step, "after"/"before", seed) flips 2
    bits of replica 0's parameters after that step's optimizer step or before its forward."""
    for step in steps:
        for rank, (model, optimizer) in enumerate(replicas):
            optimizer.zero_grad(set_to_none=True)
            if flip and flip[:2] == (step, "before") and rank == 0:
                flip_bits(list(model.parameters()), 2, flip[2])
            x, y = get_batch(DATA, step, rank, 0, 4, 16)
            model(x, y)[1].backward()
        for grads in zip(*(list(m.parameters()) for m, _ in replicas), strict=True):
            mean = sum(p.grad for p in grads) / len(grads)
            for p in grads:
                p.grad.copy_(mean)
        for rank, (model, optimizer) in enumerate(replicas):
            optimizer.step()
            if flip and flip[:2] == (step, "after") and rank == 0:
                flip_bits(list(model.parameters()), 2, flip[2])


def host(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def keep_as_an_earlier_process(monkeypatch, folder, tensors, job="job-1", step=SPLIT):
    """What a rank of the generation before the rollback kept at `step` (another pid)."""
    other = os.getpid() + 1
    with monkeypatch.context() as m:
        m.setattr(evidence.os, "getpid", lambda: other)
        evidence.record(folder, 0, job, step, tensors)


def split_and_replay(monkeypatch, tmp_path, flip) -> dict[str, evidence.Deviations]:
    """Each node's deviations when the job replays SPLIT from LAST_AGREED after `flip`."""
    agreed = [replica(), replica()]
    train(agreed, range(1, LAST_AGREED + 1))
    run = copy.deepcopy(agreed)
    train(run, range(LAST_AGREED + 1, SPLIT + 1), flip)
    for node, (model, _) in zip(("node0", "node1"), run, strict=True):
        keep_as_an_earlier_process(monkeypatch, tmp_path / node, host(model))
    replay = copy.deepcopy(agreed)
    train(replay, range(LAST_AGREED + 1, SPLIT + 1))
    found = {}
    for node, (model, _) in zip(("node0", "node1"), replay, strict=True):
        deviations = evidence.record(tmp_path / node, 0, "job-1", SPLIT, host(model))
        assert deviations is not None
        found[node] = deviations
    return found


@pytest.mark.parametrize("when", ["after", "before"])
def test_the_replay_names_the_corrupted_replica_by_its_values(monkeypatch, tmp_path, when):
    """Over 10 flips of each shape the corrupted replica (node0) is named at least 8 times and
    the other never: the flips that go unnamed are those of about one rounding unit."""
    named = []
    for seed in range(10):
        folder = tmp_path / str(seed)
        found = split_and_replay(monkeypatch, folder, (LAST_AGREED + 1 + seed % 6, when, seed))
        assert found["node0"] != found["node1"]  # the flip is still where the replicas differ
        named.append(odd_ones_out(found))
    assert ["node1"] not in named and all(n in ([], ["node0"]) for n in named)
    assert named.count(["node0"]) >= 8, named


def test_a_deterministic_replay_finds_no_deviation(monkeypatch, tmp_path):
    model, _ = replica()
    keep_as_an_earlier_process(monkeypatch, tmp_path, host(model))
    assert evidence.record(tmp_path, 0, "job-1", SPLIT, host(model)) == []


def test_evidence_of_another_job_step_or_layout_or_a_torn_file_is_not_compared(
    monkeypatch, tmp_path
):
    model, _ = replica()
    tensors = host(model)
    keep_as_an_earlier_process(monkeypatch, tmp_path, tensors, job="job-0")
    assert evidence.record(tmp_path, 0, "job-1", SPLIT, tensors) is None  # another job's
    keep_as_an_earlier_process(monkeypatch, tmp_path, tensors)
    assert evidence.record(tmp_path, 0, "job-1", SPLIT, tensors[:-1]) is None  # other layout
    assert evidence.record(tmp_path, 0, "job-1", SPLIT, tensors) is None  # own process's
    keep_as_an_earlier_process(monkeypatch, tmp_path, tensors)
    path = tmp_path / f"local0.step{SPLIT}.bin"
    path.write_bytes(path.read_bytes()[:-3])
    assert evidence.record(tmp_path, 0, "job-1", SPLIT, tensors) is None
    path.write_bytes(b"\xff" * 64)
    assert evidence.record(tmp_path, 0, "job-1", SPLIT, tensors) is None


def test_only_the_newest_steps_are_kept_and_large_parameters_not_at_all(monkeypatch, tmp_path):
    small = [torch.ones(4)]
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / ".local0.step5.bin.99999").write_bytes(b"half")  # a killed writer's
    (tmp_path / ".local1.step5.bin.99999").write_bytes(b"half")  # another local rank's
    for step in range(evidence.KEPT + 3):
        evidence.record(tmp_path, 0, "job-1", step, small)
    kept = sorted(p.name for p in tmp_path.iterdir())
    expected = [f"local0.step{s}.bin" for s in range(3, evidence.KEPT + 3)]
    assert kept == sorted([*expected, ".local1.step5.bin.99999"])
    monkeypatch.setattr(evidence, "MAX_BYTES", 8)
    assert evidence.record(tmp_path / "big", 0, "job-1", 1, small) is None
    assert not (tmp_path / "big").exists()


def test_deviations_are_in_rounding_units_largest_first():
    """A unit is eps x the larger of the element and its tensor's RMS (here 1.0)."""
    new = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    eps = torch.finfo(torch.float32).eps
    old = new.clone()
    old[1] += 8 * eps
    old[2] = 2 * eps  # near 0: in units of the RMS, not of its own tiny rounding
    old[3] += 4 * eps
    found = evidence.deviations([old], [new])
    assert [i for i, _ in found] == [1, 3, 2]
    assert found[:2] == [(1, 8.0), (3, 4.0)] and found[2][1] == pytest.approx(2.0, rel=0.1)
    assert evidence.deviations([new], [new]) == []


def test_an_element_only_one_list_shows_above_the_others_floor_names_its_node():
    drift = [(i, 100.0 - i) for i in range(evidence.TOP)]  # what both replicas share
    corrupted = [(999, 500.0), *drift[:-1]]  # the flip pushed the smallest shared one out
    assert odd_ones_out({"a": corrupted, "b": drift}) == ["a"]
    # an element both show, with other units: each node has one of its own, no name
    moved = [(0, 100.5), *drift[1:]]
    assert odd_ones_out({"a": moved, "b": drift}) == []
    # a short list holds every difference of its node: anything else is the other's own
    assert odd_ones_out({"a": [(5, 1.5), (7, 0.5)], "b": [(5, 1.5)]}) == ["a"]
    # every node with an element of its own, or none: no name
    assert odd_ones_out({"a": [(1, 3.0)], "b": [(2, 3.0)]}) == []
    assert odd_ones_out({"a": [(1, 3.0)], "b": [(1, 3.0)]}) == []


def test_the_detector_names_the_node_from_the_replays_deviations():
    first = ReplicaDetector()
    first.update(_views({10: "s"}, {10: "s"}))
    split = Split.of(first.update(_views({20: "a"}, {20: "b"})))  # type: ignore[arg-type]
    assert split is not None
    replay = ReplicaDetector(split)
    replay.update(_views({10: "s"}, {10: "s"}))
    found = replay.update(
        _views({20: "c"}, {20: "c"}, deviations=[[[5, 1.0], [9, 400.0]], [[5, 1.0]]])
    )
    assert found is not None and found.severity is Severity.INFO
    assert found.nodes == ["node0"] and found.ranks == [0] and "transient" in found.message
    assert found.evidence["deviations"]["node0"] == [(5, 1.0), (9, 400.0)]
    # malformed lists from a summary are left out: nobody named
    replay = ReplicaDetector(split)
    replay.update(_views({10: "s"}, {10: "s"}))
    bad = [[[5, "x"]], [[-1, 2.0]]]
    found = replay.update(_views({20: "c"}, {20: "c"}, deviations=bad))
    assert found is not None and found.nodes == [] and "no node to name" in found.message


def _views(*fingerprints: dict, deviations: list | None = None):
    from types import SimpleNamespace

    ranks = []
    for i, fps in enumerate(fingerprints):
        view = {"rank": i, "node": f"node{i}", "fingerprints": {str(s): d for s, d in fps.items()}}
        if deviations is not None:
            view["deviations"] = {str(s): deviations[i] for s in fps}
        ranks.append(view)
    return SimpleNamespace(ranks=ranks)
