"""What a person sees: the progress record of a snapshot, and which events the live view prints."""

from __future__ import annotations

from transom.view import EventFilter, node_rows, progress_record, status_summary


def _snap(steps: dict, generation: int = 3) -> dict:
    return {
        "time": 100.0,
        "job": {
            "state": "RUNNING",
            "generation": generation,
            "members": ["node0", "node1"],
            "since": 90.0,
            "evicted": {"node2": {"reason": "lost", "time": 80.0, "generation": 1}},
        },
        "nodes": {"node0": {}, "node1": {}, "node3": {}},
        "statuses": {
            n: {"node": n, "generation": g, "state": "running", "time": 99.0, "step": s}
            for n, (g, s) in steps.items()
        },
    }


def test_progress_is_the_step_every_member_of_the_current_generation_finished():
    record = progress_record(_snap({"node0": (3, 42), "node1": (3, 40), "node3": (3, 99)}))
    assert record == {
        "time": 100.0,
        "state": "RUNNING",
        "generation": 3,
        "step": 40,
        "step_at": 99.0,  # node1's status (written at its generation's first step) says when
        "first_step": 40,  # the statuses' steps: every member finished 40 by 99.0
        "first_step_at": 99.0,
        "members": ["node0", "node1"],
        "spares": ["node3"],
        "evicted": ["node2"],
    }
    # a member still reporting its previous generation, or no step yet: no progress in this one
    assert progress_record(_snap({"node0": (3, 42), "node1": (2, 80)}))["step"] is None
    assert progress_record(_snap({"node0": (3, 42), "node1": (3, None)}))["step"] is None
    assert progress_record({"time": 1.0, "job": None}) is None
    done = _snap({"node0": (3, 42), "node1": (3, 40)})
    done["statuses"]["node1"]["state"] = "succeeded"  # written when its workers exited
    assert progress_record(done)["step"] == 40 and progress_record(done)["step_at"] is None


def test_a_nodes_step_is_its_status_or_its_newer_summary_of_the_same_generation():
    # Statuses carry a generation's first step only; the summaries every few steps after it.
    snap = _snap({"node0": (3, 10), "node1": (3, 10), "node3": (3, 10)})
    snap["monitor"] = {
        "node0": {"node": "node0", "generation": 3, "t": 99.0, "ranks": {"0": {"step": 57}}},
        "node1": {"node": "node1", "generation": 3, "t": 99.0, "ranks": {"1": {"step": 55}}},
        "node3": {"node": "node3", "generation": 2, "t": 50.0, "ranks": {"2": {"step": 99}}},
    }
    assert progress_record(snap)["step"] == 55  # every member finished 55
    assert progress_record(snap)["step_at"] is None  # no step ages: when is unknown
    snap["monitor"]["node0"]["ranks"]["0"]["step_age"] = 0.5
    snap["monitor"]["node1"]["ranks"]["1"]["step_age"] = 0.25
    assert progress_record(snap)["step_at"] == 98.75  # node1 reached 55 at 99.0 - 0.25
    # The generation's first step stays where the statuses put it, its time the last member's.
    snap["statuses"]["node1"]["time"] = 99.5
    record = progress_record(snap)
    assert (record["first_step"], record["first_step_at"]) == (10, 99.5)
    snap["statuses"]["node1"]["state"] = "starting"  # not at a step of this generation yet
    record = progress_record(snap)
    assert record["first_step"] is record["first_step_at"] is None
    steps = {row["node"]: row["step"] for row in node_rows(snap)}
    assert steps == {"node0": 57, "node1": 55, "node2": None, "node3": 10}  # node3's is stale
    assert status_summary(snap)["newest_step"] == 57


def test_live_view_prints_each_kind_of_anomaly_once_a_generation_and_no_routine_checkpoints():
    f = EventFilter()
    nan = {"kind": "anomaly", "type": "nan", "generation": 4, "message": "nan: rank 0"}
    assert f.shown(nan)
    assert not f.shown({**nan, "message": "nan: rank 1"})
    assert f.shown({**nan, "generation": 5})
    assert f.shown({"kind": "anomaly", "type": "hang", "generation": 4, "message": "hang"})
    assert not f.shown({"kind": "checkpoint", "action": "saved", "message": "step 20 rank 0 saved"})
    assert f.shown(
        {"kind": "checkpoint", "action": "restored", "message": "rank 0 restored step 20"}
    )
    assert f.shown({"kind": "decision", "generation": 4, "message": "rollback"})
    assert f.shown(
        {"kind": "decision", "generation": 4, "message": "rollback"}
    )  # decisions: always
