"""The shared records (transom/common/records.py): round trips, and validation at the boundary."""

from __future__ import annotations

import json

import pytest

from transom.common.records import (
    Event,
    EventKind,
    FailureKind,
    FailureReport,
    JobRecord,
    LinkMeasure,
    MonitorSummary,
    NodeStatus,
    Plan,
    PreflightResult,
    RecordError,
    parse_all,
)
from transom.common.states import JobState, NodeState


def test_records_survive_json_and_tolerate_unknown_keys():
    job = JobRecord.new(100.0)
    job.members = ["node0"]
    stored = json.loads(json.dumps(job.to_dict()))
    assert stored["state"] == "PENDING" and JobRecord.from_dict(stored) == job
    newer = stored | {"a_field_from_a_newer_writer": 1}
    assert JobRecord.from_dict(newer) == job
    # an older writer without the later, optional fields
    old = {"state": "RUNNING", "generation": 2, "members": ["node0"], "since": 1.0}
    assert JobRecord.from_dict(old).restore_step is None


@pytest.mark.parametrize(
    "cls, value, why",
    [
        (JobRecord, {"state": "RUNNING", "generation": 1, "members": []}, "missing field 'since'"),
        (JobRecord, {"state": "DANCING", "generation": 1, "members": [], "since": 1}, "JobState"),
        (Plan, {"generation": "1", "members": [], "job_state": "RUNNING"}, "expected int"),
        (Plan, {"generation": 1, "members": "node0", "job_state": "RUNNING"}, "expected a list"),
        (NodeStatus, {"node": "n", "generation": 1, "state": "RUNNING", "time": 0}, "NodeState"),
        (PreflightResult, ["passed"], "expected an object"),
        (MonitorSummary, {"node": "n", "generation": 1, "t": 0, "ranks": {"0": 5}}, "ranks"),
        (Plan, {"generation": True, "members": [], "job_state": "RUNNING"}, "expected int"),
    ],
)
def test_invalid_values_raise_one_error_type(cls, value, why):
    with pytest.raises(RecordError, match=why):
        cls.from_dict(value)


def test_an_error_names_the_place_of_the_item_that_failed():
    members = ["node0", "node1", 7]
    with pytest.raises(RecordError, match=r"^Plan\.members\[2\]: expected str, got 7$"):
        Plan.from_dict({"generation": 1, "members": members, "job_state": "RUNNING"})
    ranks = {"0": {"step": 1}, "1": {"step": "one"}}
    with pytest.raises(RecordError, match=r"MonitorSummary\.ranks\['1'\]: .*step.*'one'"):
        MonitorSummary.from_dict({"node": "n", "generation": 1, "t": 0, "ranks": ranks})


def test_events_keep_extra_fields_and_omit_unused_ones():
    stored = {"time": 1.0, "kind": "fault", "message": "m", "fault": "kill", "rank": 3}
    e = Event.from_dict(stored)
    assert e.kind is EventKind.FAULT and e.extra == {"fault": "kill", "rank": 3}
    assert e.to_dict() == stored
    assert "lost" not in Event(1.0, EventKind.RUNNING, "m").to_dict()


def test_parse_all_leaves_out_invalid_values():
    good = NodeStatus("node0", 1, NodeState.RUNNING, 1.0).to_dict()
    parsed = parse_all(NodeStatus, {"node0": good, "node1": {"state": "running"}})
    assert list(parsed) == ["node0"] and parsed["node0"].state is NodeState.RUNNING
    assert JobState("RUNNING") is JobState.RUNNING


def test_a_status_keeps_its_valid_failure_reports_and_leaves_out_the_others():
    """A failure report that is not valid (another writer's, a broken agent's) costs only
    itself: the status and its other reports are read."""
    valid = FailureReport(describe="rank 1 killed by SIGKILL", time=5.0, rank=1, signal="SIGKILL")
    stored = json.loads(
        json.dumps(NodeStatus("n", 1, NodeState.FAILED, 5.0, failures=[valid]).to_dict())
    )
    junk = ["not an object", None, 7, [], {"kind": "banana"}, {"rank": "1"}, {"time": None}]
    status = NodeStatus.from_dict(stored | {"failures": [*junk, *stored["failures"]]})
    assert status.failures == [valid] and status.own_fault()
    assert NodeStatus.from_dict(stored | {"failures": junk}).failures == []
    # an older agent's report says less: a worker's failure, its own unless it says otherwise
    (old,) = NodeStatus.from_dict(stored | {"failures": [{"rank": 0}]}).failures
    assert (old.kind, old.peer_error, old.describe) == (FailureKind.WORKER, False, "worker failed")
    # a list that is no list is no status: the controller's reads leave it out
    not_a_list = stored | {"failures": {"rank": 0}}
    with pytest.raises(RecordError, match="NodeStatus.failures: expected a list"):
        NodeStatus.from_dict(not_a_list)
    assert parse_all(NodeStatus, {"n": not_a_list, "m": stored}) == {"m": status}


def test_a_preflight_result_keeps_its_valid_links_and_round_trips_through_a_status():
    """What a node measured of each peer's link comes from etcd: an entry that is not valid
    costs only itself; a failed node's status and an exclusion's event carry the typed result."""
    result = PreflightResult(
        True,
        2.0,
        compute_gflops=40.0,
        free_disk_bytes=1 << 30,
        link_mbps=900.0,
        link_latency_ms=0.2,
        links={"b": LinkMeasure(0.2, 900.0)},
    )
    stored = json.loads(json.dumps(result.to_dict()))
    assert PreflightResult.from_dict(stored) == result
    junk = {"c": {"mbps": "fast", "latency_ms": 1}, "d": None, "e": [1], "f": {"mbps": 1.0}}
    assert PreflightResult.from_dict(stored | {"links": {**junk, **stored["links"]}}) == result
    for bad, why in [
        ({"links": ["b"]}, "PreflightResult.links: expected an object"),
        ({"link_mbps": "fast"}, "PreflightResult.link_mbps: expected float"),
        ({"free_disk_bytes": 1.5}, "PreflightResult.free_disk_bytes: expected int"),
        ({"problems": "disk"}, "PreflightResult.problems: expected a list"),
    ]:
        with pytest.raises(RecordError, match=why):
            PreflightResult.from_dict(stored | bad)
    failed = NodeStatus("n", 1, NodeState.FAILED, 5.0, preflight=result, pids={"0": 42})
    assert NodeStatus.from_dict(json.loads(json.dumps(failed.to_dict()))) == failed
    with pytest.raises(RecordError, match="NodeStatus.pids"):
        NodeStatus.from_dict(failed.to_dict() | {"pids": {"0": "42"}})
    evict = Event(3.0, EventKind.EVICT, "m", node="n", preflight=result)
    assert Event.from_dict(json.loads(json.dumps(evict.to_dict()))) == evict
