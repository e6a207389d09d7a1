"""End to end: a Lightning DDP script with Transom's one-liners (tests/scripts/lightning_job.py:
`TransomCallback`, `TransomCheckpointIO`, `ckpt_path=resume_path(...)`) under `transom run` on
2 nodes. A NaN loss on rank 1 is rolled back to the checkpoint before it; a node's death is
recovered from the in-memory tiers (the restore events say memory and peer, not storage); both
jobs end with the weights of a fault-free run, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import skip_unless_installed

skip_unless_installed("lightning")
import torch  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "lightning_job.py")
ARGS = ["--steps", "40", "--step-delay", "0.1"]


def final_weights(job) -> dict:
    return torch.load(job.run_dir / "checkpoints" / "final.pt", weights_only=True)


def events(job, kind: str) -> list[dict]:
    return [e for e in job.events() if e["kind"] == kind]


def test_a_nan_is_rolled_back_and_a_node_death_resumes_from_memory_bit_identical(start_job):
    reference = start_job("--nnodes", "2", SCRIPT, *ARGS)
    assert reference.wait(timeout=300) == 0, reference.output
    expected = final_weights(reference)

    nan = start_job("--nnodes", "2", SCRIPT, *ARGS, "--nan-step", "22")
    assert nan.wait(timeout=300) == 0, nan.output
    found = [e for e in events(nan, "anomaly") if e.get("type") == "nan"]
    # Each node reports its own ranks' NaNs, in whichever order they arrive (rank 0's NaN a step
    # later, from the poisoned all-reduce, may come first): the earliest step is rank 1's 22.
    earliest = min(found, key=lambda e: e["step"]) if found else None
    assert earliest and earliest["step"] == 22 and earliest["ranks"] == [1], found
    assert [e["rollback_before"] for e in events(nan, "rollback")] == [22]
    restarted = [e for e in events(nan, "generation") if e["generation"] == 2]
    assert restarted and restarted[0]["restore_step"] == 20, restarted  # Lightning's step-20 save
    weights = final_weights(nan)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)

    death = start_job(
        *("--nnodes", "2", "--spares", "1", "--faults", "kill@step=23:node=node1"),
        SCRIPT,
        *ARGS,
    )
    assert death.wait(timeout=300) == 0, death.output
    restored = [e for e in events(death, "checkpoint") if e.get("action") == "restored"]
    # Both ranks read ModelCheckpoint's newest save from memory: node0's own, and the spare from
    # node0. That is step 20, or 25 when the kill lands after it: the agent fires at its tick
    # (0.2 s) after step 23 is reported, and a step takes 0.1 s.
    fired = [e["step"] for e in events(death, "fault")]
    steps = {e["step"] for e in restored}
    assert len(fired) == 1 and len(steps) == 1, (fired, restored)
    assert steps <= {20, 25}, (fired, restored)
    assert sorted(e["tier"] for e in restored) == ["memory", "peer"], restored
    weights = final_weights(death)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def test_every_step_snapshots_lose_at_most_the_step_in_flight_bit_identical(start_job):
    """`TransomCheckpoints` under `transom run`: a node's death restores the newest step every
    rank holds, from memory and the peer, and the job ends bit-identical to a fault-free run; a
    NaN rolls back to a step before it."""
    snapped = [*ARGS, "--snapshots", "--step-data"]
    reference = start_job("--nnodes", "2", SCRIPT, *snapped)
    assert reference.wait(timeout=300) == 0, reference.output
    expected = final_weights(reference)

    death = start_job(
        *("--nnodes", "2", "--spares", "1", "--faults", "kill@step=23:node=node1"),
        SCRIPT,
        *snapped,
    )
    assert death.wait(timeout=300) == 0, death.output
    restored = [e for e in events(death, "checkpoint") if e.get("action") == "restored"]
    # The newest step both ranks finished: 23, or 24 when the node went down during it (the kill
    # comes when step 23 is reported); never ModelCheckpoint's step 20.
    steps = {e["step"] for e in restored}
    assert len(steps) == 1 and min(steps) >= 22, restored
    assert sorted(e["tier"] for e in restored) == ["memory", "peer"], restored
    weights = final_weights(death)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)

    nan = start_job("--nnodes", "2", SCRIPT, *snapped, "--nan-step", "22")
    assert nan.wait(timeout=300) == 0, nan.output
    assert [e["rollback_before"] for e in events(nan, "rollback")] == [22]
    restored = [e for e in events(nan, "checkpoint") if e.get("action") == "restored"]
    assert restored and all(e["step"] < 22 for e in restored), restored
    weights = final_weights(nan)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
