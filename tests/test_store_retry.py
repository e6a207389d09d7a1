"""Unit tests of the store's one retry policy (store/retry.py) and of outage tracking
(store/reachability.py): a fake clock, no etcd."""

from __future__ import annotations

import json
import logging
import ssl

import pytest
from etcd3gw import exceptions as etcd_errors

from transom.store.access import StoreError
from transom.store.reachability import StoreOutage
from transom.store.retry import RetryPolicy, retry, tls_refusal, transient_reason


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds


def gateway_error(code: int, message: str) -> etcd_errors.Etcd3Exception:
    return etcd_errors.Etcd3Exception(json.dumps({"error": message, "code": code}), "reason")


def failing(errors: list[BaseException], clock: FakeClock, cost_s: float = 0.0):
    """An attempt that raises `errors` one by one (each after `cost_s`), then returns "ok"."""
    calls: list[float] = []

    def attempt(timeout_s: float) -> str:
        calls.append(timeout_s)
        clock.now += cost_s
        if errors:
            raise errors.pop(0)
        return "ok"

    return attempt, calls


def run(attempt, policy: RetryPolicy, clock: FakeClock, rand=lambda: 1.0):
    return retry(attempt, policy, "etcd", clock=clock, sleep=clock.sleep, rand=rand)


def test_transient_failures_are_retried_until_success():
    clock = FakeClock()
    errors: list[BaseException] = [
        etcd_errors.ConnectionFailedError("connection refused"),
        etcd_errors.ConnectionTimeoutError("read timed out"),
        etcd_errors.InternalServerError("oops"),
        gateway_error(14, "etcdserver: request timed out"),
        gateway_error(14, "etcdserver: leader changed"),
        gateway_error(8, "etcdserver: mvcc: database space exceeded"),
    ]
    attempt, calls = failing(errors, clock)
    assert run(attempt, RetryPolicy(deadline_s=30), clock) == "ok"
    assert len(calls) == 7


def test_backoff_grows_exponentially_is_bounded_and_jittered():
    policy = RetryPolicy(deadline_s=100, first_backoff_s=0.1, max_backoff_s=1.0)
    assert [policy.backoff_s(n, lambda: 1.0) for n in range(1, 7)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert policy.backoff_s(3, lambda: 0.0) == pytest.approx(0.2)  # jitter: 50-100 % of 0.4
    clock = FakeClock()
    attempt, _ = failing([etcd_errors.ConnectionFailedError()] * 4, clock)
    run(attempt, policy, clock, rand=lambda: 0.5)
    assert clock.sleeps == pytest.approx([0.075, 0.15, 0.3, 0.6])


@pytest.mark.parametrize(
    "error",
    [
        gateway_error(3, "etcdserver: key is not provided"),  # invalid argument
        gateway_error(7, "etcdserver: permission denied"),
        gateway_error(16, "etcdserver: invalid auth token"),
        etcd_errors.Etcd3Exception("not json", "Bad Request"),
        ValueError("a bug, not etcd"),
    ],
)
def test_failures_no_retry_can_fix_are_raised_at_once(error):
    clock = FakeClock()
    attempt, calls = failing([error], clock)
    with pytest.raises(type(error)):
        run(attempt, RetryPolicy(deadline_s=30), clock)
    assert len(calls) == 1 and clock.sleeps == []


def test_a_refused_certificate_is_not_transient_but_a_cut_handshake_is():
    def wrapped(inner: BaseException) -> BaseException:
        """`inner` wrapped as etcd3gw wraps requests' wrapping of ssl's error."""
        try:
            try:
                try:
                    raise inner
                except ssl.SSLError as e:
                    raise OSError("requests' wrapper") from e
            except OSError as e:
                raise etcd_errors.ConnectionFailedError("wrapped") from e
        except etcd_errors.ConnectionFailedError as e:
            return e
        raise AssertionError("unreachable")

    refused = ssl.SSLError(1, "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] alert")
    refused.reason = "TLSV13_ALERT_CERTIFICATE_REQUIRED"
    error = wrapped(refused)
    assert tls_refusal(error) == "TLSV13_ALERT_CERTIFICATE_REQUIRED"
    assert transient_reason(error) is None
    cut = wrapped(ssl.SSLEOFError(8, "EOF occurred in violation of protocol"))
    assert tls_refusal(cut) is None
    assert transient_reason(cut) is not None


def test_after_the_deadline_a_store_error_says_why():
    clock = FakeClock()
    attempt, calls = failing([etcd_errors.ConnectionFailedError("refused")] * 1000, clock, 0.01)
    with pytest.raises(StoreError, match=r"etcd: gave up after 3\.0 s .*connection failed"):
        run(attempt, RetryPolicy(deadline_s=3), clock)
    assert clock.now - 100.0 <= 3.0 + 0.01 + 1e-9  # waits never pass the deadline: one try at it
    assert 5 < len(calls) < 30


def test_each_attempt_ends_by_the_deadline():
    clock = FakeClock()
    policy = RetryPolicy(deadline_s=3, request_timeout_s=5)
    attempt, calls = failing([etcd_errors.ConnectionTimeoutError("timed out")] * 1000, clock)

    def slow(timeout_s: float) -> str:
        clock.now += timeout_s  # every attempt hangs for its whole time limit
        return attempt(timeout_s)

    with pytest.raises(StoreError):
        run(slow, policy, clock)
    assert calls[0] == 3.0  # not the request timeout: what is left of the deadline
    assert all(t >= 0.5 for t in calls)  # an attempt always has a usable time limit
    assert clock.now - 100.0 <= 3.0 + 0.5


def test_a_policy_needs_a_positive_deadline():
    with pytest.raises(ValueError):
        RetryPolicy(deadline_s=0)


def test_an_outage_is_logged_once_when_it_begins_and_once_when_it_ends(caplog):
    clock = FakeClock()
    outage = StoreOutage("agent node0", clock=clock)
    assert outage.ok() is None and not outage.over(0)
    with caplog.at_level(logging.WARNING, logger="transom.store"):
        for _ in range(5):
            outage.failed(StoreError("cannot reach etcd: refused"))
            clock.now += 2.0
        assert outage.lasted() == pytest.approx(10.0)
        assert outage.over(9.0) and not outage.over(11.0)
        assert outage.ok() == pytest.approx(10.0)
        assert outage.ok() is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "agent node0: etcd unreachable (cannot reach etcd: refused); riding it out",
        "agent node0: etcd reachable again after 10.0 s",
    ]
