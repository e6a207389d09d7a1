"""End to end: a Hugging Face `Trainer` DDP script with Transom's lines (tests/scripts/hf_job.py:
`TransomCallback`, `TransomCheckpoints`, `resume_from_checkpoint=resume_checkpoint(...)`) under
`transom run` on 2 nodes, snapshotted every step. A NaN loss on rank 1 is rolled back to the
step before it; a node's death is recovered from the in-memory tiers (the restore events say
memory or peer, never storage) at the step in flight at most; both jobs end with the model of a
fault-free run, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import skip_unless_installed

skip_unless_installed("transformers")
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "hf_job.py")
ARGS = ["--steps", "40", "--save-steps", "10", "--step-delay", "0.1"]
ENV = {"HF_HUB_OFFLINE": "1"}


def final_model(job) -> dict:
    return load_file(job.run_dir / "checkpoints" / "hf" / "final" / "model.safetensors")


def events(job, kind: str) -> list[dict]:
    return [e for e in job.events() if e["kind"] == kind]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_nan_is_rolled_back_and_a_node_death_resumes_from_memory_bit_identical(start_job):
    reference = start_job("--nnodes", "2", SCRIPT, *ARGS, env=ENV)
    assert reference.wait(timeout=300) == 0, reference.output
    expected = final_model(reference)

    nan = start_job("--nnodes", "2", SCRIPT, *ARGS, "--nan-step", "23", env=ENV)
    assert nan.wait(timeout=300) == 0, nan.output
    found = [e for e in events(nan, "anomaly") if e.get("type") == "nan"]
    # Each node reports its own ranks' NaNs, in whichever order they arrive (rank 0's NaN at 24,
    # from the poisoned all-reduce, may come first): the earliest step is rank 1's 23.
    earliest = min(found, key=lambda e: e["step"]) if found else None
    assert earliest and earliest["step"] == 23 and earliest["ranks"] == [1], found
    assert [e["rollback_before"] for e in events(nan, "rollback")] == [23]
    restarted = [e for e in events(nan, "generation") if e["generation"] == 2]
    # The plan names a step the catalog listed below 23; the ranks agree on the newest they
    # hold from there: 22, the step before the NaN (rank 1 snapshotted no poisoned step).
    assert restarted and 20 <= restarted[0]["restore_step"] <= 22, restarted
    restored = [e for e in events(nan, "checkpoint") if e.get("action") == "restored"]
    assert restored and {e["step"] for e in restored} == {22}, restored
    assert same(final_model(nan), expected)

    death = start_job(
        *("--nnodes", "2", "--spares", "1", "--faults", "kill@step=23:node=node1"),
        SCRIPT,
        *ARGS,
        env=ENV,
    )
    assert death.wait(timeout=300) == 0, death.output
    restored = [e for e in events(death, "checkpoint") if e.get("action") == "restored"]
    # A snapshot every step: the step in flight at most is lost. The fault is injected once
    # the job reports step 23; node1 may have finished a step or two more before it died, and
    # the ranks then restore the newest step they all hold (bit-identical below).
    steps = {e["step"] for e in restored}
    assert restored and len(steps) == 1 and min(steps) >= 22, restored
    assert {e["tier"] for e in restored} <= {"memory", "peer"}, restored  # never storage
    assert same(final_model(death), expected)
