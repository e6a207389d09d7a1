"""End to end: a silent bit flip in one rank's parameters (the `corrupt` fault: no NaN, no loss
spike) of a 3-node examples/train_gpt.py job is found by the replicas' fingerprints at the next
fingerprint step, blamed on its node, rolled back to a checkpoint of the last agreeing step or
before, the node replaced by the spare; the run ends with the weights of a fault-free run."""

from __future__ import annotations

import pytest
from conftest import REPO

from transom.common import env
from transom.report.weights import compare_files

pytestmark = pytest.mark.slow

TRAIN = str(REPO / "examples" / "train_gpt.py")
ARGS = [TRAIN, "--steps", "60", "--ckpt-every", "10", "--step-delay", "0.05", "--seed", "3"]
EVERY = {env.FINGERPRINT_EVERY: "10"}


def test_a_silent_bit_flip_is_found_on_its_node_and_rolled_back_bit_identical(start_job, tmp_path):
    job = start_job(
        *("--nnodes", "3", "--spares", "1", "--faults", "corrupt@step=23:rank=1:bits=2"),
        *ARGS,
        *("--save-final", str(tmp_path / "corrupted.pt")),
        env=EVERY,
    )
    assert job.wait(timeout=300) == 0, job.output
    events = job.events()
    found = [e for e in events if e["kind"] == "anomaly" and e.get("type") == "sdc"]
    # Script step 23 is the optimizer's step 22: the next fingerprint is step 30; 20 agreed.
    assert len(found) == 1 and found[0]["nodes"] == ["node1"] and found[0]["step"] == 30, found
    assert found[0]["evidence"]["last_agreeing_step"] == 20
    assert [e["rollback_before"] for e in events if e["kind"] == "rollback"] == [21]
    assert [e.get("node") for e in events if e["kind"] == "evict"] == ["node1"]
    restored = {
        e["step"] for e in events if e["kind"] == "checkpoint" and e.get("action") == "restored"
    }
    assert restored == {20}, restored

    reference = start_job(
        "--nnodes", "3", *ARGS, "--save-final", str(tmp_path / "reference.pt"), env=EVERY
    )
    assert reference.wait(timeout=300) == 0, reference.output
    assert not [e for e in reference.events() if e.get("type") == "sdc"]  # replicas agree
    weights = compare_files(tmp_path / "corrupted.pt", tmp_path / "reference.pt")
    assert weights["identical"], weights
