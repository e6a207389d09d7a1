"""Which nodes run a controller candidate (transom.control.candidacy): the first N live nodes, the
next promoted when one leaves, a reordered one demoted only after a while, nothing trusted."""

from __future__ import annotations

import time

import pytest

from transom.common import keys
from transom.control.candidacy import DEMOTE_AFTER_S, Candidacy, demote_after_s, first_live
from transom.job_spec import JobSpec
from transom.store import StoreError


def _registered(*nodes: str) -> dict[str, object]:
    """Registrations of `nodes`, in that order (`since` 1, 2, ...)."""
    return {n: {"node": n, "since": float(i)} for i, n in enumerate(nodes, 1)}


def test_the_first_live_nodes_in_registration_order():
    assert first_live(_registered("node10", "node2", "node3"), 2) == ["node10", "node2"]
    assert first_live(_registered("b"), 3) == ["b"]
    assert first_live({}, 3) == []
    same = {n: {"since": 5} for n in ("node10", "node2", "node1")}  # then node id order
    assert first_live(same, 3) == ["node1", "node2", "node10"]


def test_nothing_read_is_trusted():
    values: dict = {
        "n1": "not a registration",
        "n2": {"since": "yesterday"},
        "n3": {"since": float("nan")},
        "n4": {"since": True},
        "n5": {"since": 7.0},
        "n6": [1, 2],
        "n7": {"since": float("-inf")},
    }
    assert first_live(values, 2) == ["n5", "n1"]  # the malformed ones last, in node id order
    names = {name: {"since": 1.0} for name in ("../up", "", "has space", "a" * 65, "n2")}
    assert first_live(names | {7: {}, None: {}}, 3) == ["n2"]
    assert first_live(_registered("n1"), -1) == []


class _Registrations:
    """A stand-in for the watched `nodes/` keys."""

    def __init__(self, *nodes: str, fail: bool = False) -> None:
        self.values: dict[str, object] = _registered(*nodes)
        self.fail = fail

    def register(self, node: str, since: float) -> None:
        self.values[node] = {"node": node, "since": since}

    def start_once(self, now: float) -> None:
        if self.fail:
            raise StoreError("etcd does not answer")

    def refresh(self, now: float) -> None:
        pass

    def stop(self) -> None:
        pass


def _candidacy(*nodes: str, n: int = 2, demote_after_s: float = 10.0) -> Candidacy:
    candidacy = Candidacy.__new__(Candidacy)
    candidacy.n, candidacy.demote_after_s, candidacy._out_since = n, demote_after_s, {}
    candidacy.registrations = _Registrations(*nodes)  # type: ignore[assignment]
    return candidacy


def test_a_node_among_the_first_runs_one_and_the_next_is_promoted_when_one_leaves():
    c = _candidacy("n1", "n2", "n3", "n4")
    assert c.keep(["n1"], [], 0.0) == {"n1"}
    assert c.keep(["n3", "n4"], [], 0.0) == set()  # only watch
    del c.registrations.values["n1"]  # its lease expired: n3 is promoted at once
    assert c.keep(["n3", "n4"], [], 1.0) == {"n3"}


def test_a_node_that_registers_later_displaces_no_candidate():
    c = _candidacy("n5", "n3")
    assert c.keep(["n3", "n5"], [], 0.0) == {"n3", "n5"}
    c.registrations.register("n1", 10.0)  # a lower id, later
    assert c.keep(["n1"], [], 1.0) == set()


def test_a_candidate_out_of_the_first_stops_only_after_a_while():
    c = _candidacy("n2", "n3", demote_after_s=10.0)
    assert c.keep(["n3"], [], 0.0) == {"n3"}
    c.registrations.register("n3", 10.0)  # its agent registered again, after n1
    c.registrations.register("n1", 5.0)
    assert c.keep(["n3"], ["n3"], 1.0) == {"n3"}
    assert c.keep(["n3"], ["n3"], 10.5) == {"n3"}
    assert c.keep(["n3"], ["n3"], 11.0) == set()
    # promoted again later, it gets the full while again
    del c.registrations.values["n1"]
    assert c.keep(["n3"], [], 20.0) == {"n3"}
    c.registrations.register("n1", 5.0)
    assert c.keep(["n3"], ["n3"], 25.0) == {"n3"}


def test_every_lease_revoked_at_once_stops_no_candidate_at_once():
    c = _candidacy("n1", "n2")
    assert c.keep(["n1"], [], 0.0) == {"n1"}
    c.registrations.values.clear()  # etcd revoked every lease: the agents register again
    assert c.keep(["n1"], ["n1"], 1.0) == {"n1"}
    c.registrations.register("n1", 3.0)
    assert c.keep(["n1"], ["n1"], 5.0) == {"n1"}
    assert c.keep(["n1"], ["n1"], 50.0) == {"n1"}


def test_a_long_node_ttl_keeps_a_candidate_longer():
    spec = JobSpec(script=__file__, node_ttl_s=4)
    assert demote_after_s(spec) == DEMOTE_AFTER_S
    spec.node_ttl_s = 20
    assert demote_after_s(spec) == 2 * (20 + 2)


def test_an_unreadable_etcd_is_the_callers_to_ride_out():
    c = _candidacy("n1")
    c.registrations = _Registrations(fail=True)  # type: ignore[assignment]
    with pytest.raises(StoreError):
        c.keep(["n1"], ["n1"], 0.0)


@pytest.mark.integration
def test_registrations_followed_in_etcd_with_malformed_values(store):
    store.put(keys.node("n2"), "not a registration")
    store.put(keys.node("n1"), {"node": "n1", "since": 5.0})
    store.put(keys.NODES + "../x", [1, 2])
    candidacy = Candidacy(store, 1)
    try:
        assert candidacy.keep(["n1", "n2"], [], time.monotonic()) == {"n1"}
        store.delete(keys.node("n1"))
        deadline = time.monotonic() + 10
        while candidacy.keep(["n1", "n2"], [], time.monotonic()) != {"n2"}:
            assert time.monotonic() < deadline, "n2 was not promoted"
            time.sleep(0.05)
    finally:
        candidacy.stop()
