"""When the launcher replaces an evicted simulated node (transom.spare_refill)."""

from __future__ import annotations

from transom.common.records import Eviction, JobRecord
from transom.common.states import JobState
from transom.spare_refill import RUNNING_S, WAIT_S, SpareRefill

T0 = 1_000.0
LOCAL = ["node0", "node1", "node2"]


def job(state: JobState, generation: int, since: float, *evicted: str) -> JobRecord:
    return JobRecord(
        state,
        generation,
        ["node0", "node2"],
        since,
        evicted={n: Eviction("hang", T0, generation - 1) for n in evicted},
    )


def test_a_replacement_waits_until_the_new_generation_trained_then_starts_once():
    refill = SpareRefill()
    restarting = job(JobState.WARMUP, 3, T0, "node1")
    assert refill.due(restarting, LOCAL, trained_generation=2, now=T0) == []
    running = job(JobState.RUNNING, 3, T0 + 0.2, "node1")
    assert refill.due(running, LOCAL, trained_generation=2, now=T0 + 0.3) == []  # no step yet
    assert refill.due(running, LOCAL, trained_generation=3, now=T0 + 0.9) == ["node1"]
    assert refill.due(running, LOCAL, trained_generation=3, now=T0 + 1.0) == []  # once


def test_without_progress_a_generation_running_for_a_while_counts_as_training():
    refill = SpareRefill()
    running = job(JobState.RUNNING, 3, T0, "node1")
    assert refill.due(running, LOCAL, None, T0 + RUNNING_S / 2) == []
    assert refill.due(running, LOCAL, None, T0 + RUNNING_S) == ["node1"]


def test_a_job_waiting_for_nodes_or_on_an_incident_gets_its_replacement_at_once():
    # The kill torture: an agent died while the job recovered from another's death, with no
    # spare; the replacement it waited for would have been too late.
    assert SpareRefill().due(job(JobState.PENDING, 3, T0, "node1"), LOCAL, 2, T0) == ["node1"]
    assert SpareRefill().due(job(JobState.RECOVERING, 3, T0, "node1"), LOCAL, 3, T0) == ["node1"]


def test_a_generation_that_does_not_train_gets_its_replacement_soon_all_the_same():
    refill = SpareRefill()
    stuck = job(JobState.WARMUP, 3, T0, "node1")
    assert refill.due(stuck, LOCAL, 2, T0) == []
    assert refill.due(stuck, LOCAL, 2, T0 + WAIT_S / 2) == []
    assert refill.due(stuck, LOCAL, 2, T0 + WAIT_S) == ["node1"]  # from when it was first seen


def test_only_this_launchers_nodes_are_replaced():
    running = job(JobState.RUNNING, 3, T0, "node1", "other-machine-node")
    assert SpareRefill().due(running, LOCAL, 3, T0) == ["node1"]
    assert SpareRefill().due(None, LOCAL, 3, T0) == []


def test_a_node_set_aside_is_replaced_without_waiting_for_its_lease():
    # Taken for dead while its lease holds (evicted only when it expires, up to a TTL later): a
    # second death in that time must find its replacement on the way.
    recovering = job(JobState.RECOVERING, 4, T0)
    recovering.set_aside = {"node2": T0}
    refill = SpareRefill()
    assert refill.due(recovering, LOCAL, 3, T0) == ["node2"]
    recovering.evicted = {"node2": Eviction("node lost", T0 + 8, 4)}
    assert refill.due(recovering, LOCAL, 3, T0 + 8) == []  # once
