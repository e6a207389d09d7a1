"""Unit tests for transom/control/policy.py: blame, eviction and fail-fast rules."""

from __future__ import annotations

from transom.common.records import FailureKind, FailureReport, NodeStatus
from transom.common.states import NodeState
from transom.control.policy import Diagnosis, SameError, diagnose, root_cause, same_error

WINDOW = 300.0


def failure(
    rank: int,
    *,
    exitcode: int = 1,
    signal: str | None = None,
    signature: str | None = None,
    peer_error: bool = False,
    time: float = 1000.0,
) -> FailureReport:
    """A worker's failure as the agent reports it (transom.control.failures.classify_exit)."""
    how = f"killed by {signal}" if signal else f"exit code {exitcode}"
    detail = f": {signature}" if signature else ""
    return FailureReport(
        FailureKind.WORKER,
        f"rank {rank} {how}{detail}",
        time,
        peer_error,
        rank,
        0,
        exitcode,
        signal,
        signature,
        f"/tmp/rank{rank}.log",
    )


def report(*failures: FailureReport, generation: int = 1) -> NodeStatus:
    return NodeStatus("node", generation, NodeState.FAILED, 1000.0, failures=list(failures))


def preflight_report(problem: str) -> NodeStatus:
    return report(FailureReport(FailureKind.PREFLIGHT, problem))


PEER = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242"


def _decide(
    members,
    lost=(),
    failed=None,
    history=None,
    last_signature=None,
    now=1000.0,
    window=WINDOW,
    before=None,
) -> Diagnosis:
    return diagnose(
        list(members),
        list(lost),
        failed or {},
        {} if history is None else history,
        last_signature,
        window,
        now,
        before,
    )


# -- root cause -------------------------------------------------------------------------------


def test_lone_sigkilled_worker_is_blamed_not_its_peers():
    failed = {
        "node0": report(failure(0, signature=PEER, peer_error=True, time=1001.0)),
        "node1": report(failure(1, exitcode=-9, signal="SIGKILL", time=1002.0)),
        "node2": report(failure(2, signature=PEER, peer_error=True, time=1000.5)),
    }
    assert root_cause(failed) == ["node1"]
    d = _decide(["node0", "node1", "node2"], failed=failed)
    assert d.blamed == ["node1"]
    assert d.evict == {}  # first failure of node1: restart, no eviction
    assert d.fail is None
    assert d.signature is None
    assert "node1" in d.summary and "SIGKILL" in d.summary


def test_all_peer_errors_blame_the_earliest_node():
    failed = {
        "node0": report(failure(0, signature=PEER, peer_error=True, time=1003.0)),
        "node1": report(
            failure(1, signature=PEER, peer_error=True, time=1001.0),
            failure(2, signature=PEER, peer_error=True, time=1005.0),
        ),
        "node2": report(failure(3, signature=PEER, peer_error=True, time=1002.0)),
    }
    assert root_cause(failed) == ["node1"]
    d = _decide(["node0", "node1", "node2"], failed=failed)
    assert d.blamed == ["node1"]


def test_root_cause_of_nothing_is_nobody():
    assert root_cause({}) == []


def test_several_own_failures_are_all_blamed():
    failed = {
        "node1": report(failure(1, signature="ValueError: x")),
        "node0": report(failure(0, exitcode=-11, signal="SIGSEGV")),
        "node2": report(failure(2, signature=PEER, peer_error=True)),
    }
    assert root_cause(failed) == ["node0", "node1"]


# -- lost nodes and pre-flight ----------------------------------------------------------------


def test_lost_node_is_evicted_with_a_lease_reason():
    history: dict[str, list[float]] = {}
    failed = {"node0": report(failure(0, signature=PEER, peer_error=True))}
    d = _decide(["node0", "node1"], lost=["node1"], failed=failed, history=history)
    assert d.blamed == ["node1"]  # the survivors' peer errors are not blamed
    assert set(d.evict) == {"node1"}
    assert "lease" in d.evict["node1"]
    assert "node1 lost" in d.summary
    assert d.fail is None


def test_preflight_failure_evicts_the_node():
    failed = {"node2": preflight_report("only 12 MiB of disk free")}
    d = _decide(["node0", "node1", "node2"], failed=failed)
    assert set(d.evict) == {"node2"}
    assert "pre-flight" in d.evict["node2"]
    assert "only 12 MiB of disk free" in d.evict["node2"]
    assert d.signature is None
    assert d.fail is None


# -- repeated failures and the eviction window ------------------------------------------------


def test_same_node_failing_again_within_the_window_is_evicted():
    history: dict[str, list[float]] = {}
    members = ["node0", "node1"]
    failed = {
        "node1": report(failure(1, exitcode=-9, signal="SIGKILL")),
        "node0": report(failure(0, signature=PEER, peer_error=True)),
    }

    first = _decide(members, failed=failed, history=history, now=1000.0)
    assert first.blamed == ["node1"] and first.evict == {}
    assert history == {"node1": [1000.0]}  # updated in place

    second = _decide(members, failed=failed, history=history, now=1100.0)
    assert second.blamed == ["node1"]
    assert set(second.evict) == {"node1"}
    assert "again" in second.evict["node1"]
    assert history["node1"] == [1000.0, 1100.0]


def test_same_node_failing_again_outside_the_window_is_not_evicted():
    history: dict[str, list[float]] = {"node1": [1000.0]}
    failed = {"node1": report(failure(1, exitcode=-9, signal="SIGKILL"))}
    d = _decide(["node0", "node1"], failed=failed, history=history, now=1000.0 + WINDOW + 1)
    assert d.blamed == ["node1"]
    assert d.evict == {}
    assert history == {"node1": [1000.0 + WINDOW + 1]}  # the old failure was forgotten


def test_history_of_other_nodes_does_not_evict():
    history: dict[str, list[float]] = {"node0": [990.0]}
    failed = {"node1": report(failure(1, exitcode=-9, signal="SIGKILL"))}
    d = _decide(["node0", "node1"], failed=failed, history=history, now=1000.0)
    assert d.evict == {}
    assert history["node0"] == [990.0]
    assert history["node1"] == [1000.0]


# -- common signature and fail-fast -----------------------------------------------------------


def _same_error_everywhere(signature: str = "ValueError: bad shape") -> dict:
    return {
        "node0": report(failure(0, signature=signature), failure(1, signature=signature)),
        "node1": report(failure(2, signature=signature), failure(3, signature=signature)),
    }


def test_same_exception_on_every_member_once_does_not_fail():
    d = _decide(["node0", "node1"], failed=_same_error_everywhere(), last_signature=None)
    assert d.signature == "ValueError: bad shape"
    assert d.fail is None


def test_same_exception_on_every_member_twice_in_a_row_fails():
    history: dict[str, list[float]] = {}
    members = ["node0", "node1"]
    first = _decide(members, failed=_same_error_everywhere(), history=history, now=1000.0)
    assert first.fail is None
    second = _decide(
        members,
        failed=_same_error_everywhere(),
        history=history,
        last_signature=first.signature,
        now=1001.0,
    )
    assert second.fail is not None
    assert "ValueError: bad shape" in second.fail


def test_the_same_exception_again_fails_before_the_slowest_node_reports():
    members = ["node0", "node1"]
    first = _decide(members, failed=_same_error_everywhere(), now=1000.0)
    only_node0 = {"node0": _same_error_everywhere()["node0"]}
    second = _decide(members, failed=only_node0, last_signature=first.signature, now=1001.0)
    assert second.fail is not None and "ValueError: bad shape" in second.fail


def test_a_different_exception_the_second_time_does_not_fail():
    d = _decide(
        ["node0", "node1"],
        failed=_same_error_everywhere("KeyError: 'x'"),
        last_signature="ValueError: bad shape",
    )
    assert d.signature == "KeyError: 'x'"
    assert d.fail is None


def _common(failed: dict) -> str | None:
    """The error every member of a 2-node job raised, by a diagnosis of this incident alone."""
    return _decide(["node0", "node1"], failed=failed).signature


def test_different_signatures_give_no_common_signature():
    failed = {
        "node0": report(failure(0, signature="ValueError: a")),
        "node1": report(failure(1, signature="ValueError: b")),
    }
    assert _common(failed) is None and same_error(failed, None) is None


def test_a_signal_gives_no_common_signature():
    sig = "ValueError: bad shape"
    failed = {
        "node0": report(failure(0, signature=sig)),
        "node1": report(failure(1, signature=sig, exitcode=-9, signal="SIGKILL")),
    }
    assert _common(failed) is None and same_error(failed, None) is None


def test_a_peer_error_gives_no_common_signature():
    failed = {
        "node0": report(failure(0, signature=PEER, peer_error=True)),
        "node1": report(failure(1, signature=PEER, peer_error=True)),
    }
    assert _common(failed) is None and same_error(failed, None) is None
    d = _decide(["node0", "node1"], failed=failed, last_signature=PEER)
    assert d.fail is None


def test_a_missing_member_or_signature_gives_no_common_signature():
    sig = "ValueError: bad shape"
    only_one = {"node0": report(failure(0, signature=sig))}
    assert _common(only_one) is None
    no_sig = {"node0": report(failure(0, signature=sig)), "node1": report(failure(1))}
    assert _common(no_sig) is None
    preflight = {"node0": report(failure(0, signature=sig)), "node1": preflight_report("disk full")}
    assert _common(preflight) is None


# Ranks that start seconds apart (one node's interpreter still importing torch) each reach the
# error first in a different generation: the evidence is gathered over the generations.
SIG = "ValueError: bad config value"


def _alone(node: str, rank: int, *, step: int | None = None, signature: str = SIG) -> dict:
    failed = report(failure(rank, signature=signature))
    failed.step = step
    return {node: failed}


def test_the_same_error_on_each_node_in_turn_is_every_rank_raising_it():
    members, history = ["node0", "node1"], {}
    g1 = _decide(members, failed=_alone("node1", 1), history=history, now=1000.0)
    assert g1.signature is None and g1.same_error == SameError(SIG, frozenset({"node1"}))
    assert g1.fail is None  # one retry, whatever
    g2 = _decide(
        members, failed=_alone("node0", 0), history=history, now=1001.0, before=g1.same_error
    )
    # Every rank has raised it now, and it came back after a restart: no second retry.
    assert g2.signature == SIG and g2.fail is not None and SIG in g2.fail
    assert g2.evict == {}


def test_the_same_error_on_every_rank_at_once_is_retried_once():
    members = ["node0", "node1"]
    both = _alone("node0", 0) | _alone("node1", 1)
    g1 = _decide(members, failed=both)
    assert g1.signature == SIG and g1.fail is None
    g2 = _decide(members, failed=_alone("node0", 0), last_signature=SIG, before=g1.same_error)
    assert g2.fail is not None and "same error twice" in g2.fail


def test_an_error_gathered_over_generations_but_not_on_every_rank_is_no_script_error():
    members = ["node0", "node1", "node2"]
    g1 = _decide(members, failed=_alone("node0", 0))
    g2 = _decide(members, failed=_alone("node1", 1), before=g1.same_error)
    assert g2.signature is None and g2.fail is None and g2.same_error is not None
    g3 = _decide(members, failed=_alone("node2", 2), before=g2.same_error)
    assert g3.signature == SIG and g3.fail is not None


def test_a_node_failing_again_with_an_error_every_member_raised_is_not_evicted():
    members = ["node0", "node1"]
    before = SameError(SIG, frozenset({"node0", "node1"}))
    d = _decide(members, failed=_alone("node1", 1), history={"node1": [999.0]}, before=before)
    assert d.evict == {} and d.signature == SIG and d.fail is not None
    alone = _decide(members, failed=_alone("node1", 1), history={"node1": [999.0]})
    assert "node1" in alone.evict  # its error alone: a node that fails again is evicted


def test_nodes_raising_one_error_while_others_do_not_are_evicted_as_ever():
    """Two bad nodes of three may raise the same error (a GPU that fails to initialise): that
    is no script's error yet, and the one failing again is evicted."""
    members = ["node0", "node1", "node2"]
    before = SameError(SIG, frozenset({"node0", "node1"}))
    d = _decide(members, failed=_alone("node1", 1), history={"node1": [999.0]}, before=before)
    assert "node1" in d.evict and d.signature is None


def test_the_evidence_is_not_carried_over_a_generation_that_trained_or_another_error():
    members = ["node0", "node1"]
    g1 = _decide(members, failed=_alone("node1", 1))
    trained = _decide(members, failed=_alone("node0", 0, step=7), before=g1.same_error)
    assert trained.signature is None and trained.same_error is not None
    after_trained = _decide(members, failed=_alone("node1", 1), before=trained.same_error)
    assert after_trained.signature is None
    other = _decide(
        members, failed=_alone("node0", 0, signature="KeyError: 'x'"), before=g1.same_error
    )
    assert other.signature is None
    assert other.same_error == SameError("KeyError: 'x'", frozenset({"node0"}))


# -- a checkpoint no rank can load ----------------------------------------------------------------


def _load_failed(rank: int, own: str | None) -> FailureReport:
    """Rank `rank` raising agreement.py's error: `own` its bad copies, None when its own were
    good (then it says another rank's were bad, and its agent counts it as a peer's failure)."""
    from transom.checkpoint.client import LOAD_FAILED, PEER_COPIES_BAD

    detail = f": {own}" if own else f" ({PEER_COPIES_BAD})"
    signature = f"transom.checkpoint.client.CheckpointError: {LOAD_FAILED}{detail}"
    return failure(rank, signature=signature, peer_error=own is None)


def test_a_checkpoint_no_rank_can_load_evicts_nobody_and_is_retried():
    """Every rank raised the load failure, one naming its bad copies, the other that another
    rank's were bad: one error of the job's, no node to blame, and no bug of the script (a
    plan may name a step evicted since: the next one may load)."""
    members, history = ["node0", "node1"], {}
    failed = {
        "node0": report(_load_failed(0, "step 4 rank 0: memory: no such region")),
        "node1": report(_load_failed(1, None)),
    }
    g1 = _decide(members, failed=failed, history=history, now=1000.0)
    assert g1.signature is not None and g1.fail is None  # one retry
    assert g1.evict == {}
    other = {
        "node0": report(_load_failed(0, None)),
        "node1": report(_load_failed(1, "step 3 rank 1: peer: refused")),
    }
    g2 = _decide(
        members,
        failed=other,
        history=history,
        last_signature=g1.signature,
        now=1001.0,
        before=g1.same_error,
    )
    assert g2.evict == {}
    assert g2.fail is None


def test_a_load_failure_then_another_error_does_not_fail():
    members = ["node0", "node1"]
    failed = {"node0": report(_load_failed(0, "bad")), "node1": report(_load_failed(1, None))}
    g1 = _decide(members, failed=failed)
    g2 = _decide(
        members,
        failed=_same_error_everywhere(),
        last_signature=g1.signature,
        before=g1.same_error,
    )
    assert g2.fail is None
