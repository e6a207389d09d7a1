"""The one retry policy of every etcd request: which failures pass, and how long to wait for them.

etcd is reached over HTTP (its gRPC gateway). A failure that time may fix (connection refused
or reset, a request that timed out, etcd answering 5xx, "request timed out", "leader changed",
"too many requests", a full database the upkeep is compacting) is *transient*: the request is
sent again after a bounded, jittered exponential backoff until the policy's deadline. A failure
that no retry can fix (a certificate refused, permission denied, a bad request) is raised at
once. Each attempt gets a time limit that ends no later than the deadline, so a call never
blocks much longer than its deadline, however etcd stalls.

`retry` is pure (clock, sleep and randomness are injectable); `transient_reason` only looks at
an error. This module must never retry a failure it cannot name as transient, and never wait
past a deadline.
"""

from __future__ import annotations

import json
import logging
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from etcd3gw import exceptions as etcd_errors

from transom.store.access import StoreError

log = logging.getLogger("transom.store")

T = TypeVar("T")

# A few seconds: below the default node lease (4 s), so a call that gives up leaves its caller
# time to act before its own lease can expire. Long-lived callers may pass a longer one.
DEFAULT_DEADLINE_S = 4.0
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
MIN_ATTEMPT_S = 0.5  # an attempt's time limit is never shorter than this

# gRPC status codes (etcd puts them in the gateway's error body) that time may fix.
_TRANSIENT_GRPC = {
    4: "deadline exceeded",
    8: "resource exhausted",
    10: "aborted",
    13: "internal error",
    14: "unavailable",
}
# SSL errors that are a connection cut mid-handshake, not a refused certificate.
_SSL_CUT = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)


@dataclass(frozen=True)
class RetryPolicy:
    """Retry transient failures for up to `deadline_s` seconds in all, waiting between attempts
    `first_backoff_s`, doubling up to `max_backoff_s`, each wait jittered to 50-100 %; each
    attempt may take at most `request_timeout_s` (and never past the deadline)."""

    deadline_s: float = DEFAULT_DEADLINE_S
    request_timeout_s: float = 5.0
    first_backoff_s: float = FIRST_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S

    def __post_init__(self) -> None:
        if self.deadline_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("a retry deadline and a request timeout must be positive")

    def backoff_s(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """The wait after failed attempt number `attempt` (1, 2, ...)."""
        base = min(self.max_backoff_s, self.first_backoff_s * 2.0 ** (attempt - 1))
        return base * (0.5 + 0.5 * rand())

    def attempt_timeout_s(self, remaining_s: float) -> float:
        return min(self.request_timeout_s, max(MIN_ATTEMPT_S, remaining_s))


def ssl_failure(error: BaseException) -> ssl.SSLError | None:
    """The SSL error behind `error` (etcd3gw wraps requests' errors, which wrap ssl's), if any."""
    seen: BaseException | None = error
    for _ in range(16):  # a chain is short; this bounds a cyclic one
        if seen is None:
            break
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def tls_refusal(error: BaseException) -> str | None:
    """The reason when `error` is a certificate refused (ours by etcd, or etcd's by us)."""
    failure = ssl_failure(error)
    if failure is None or isinstance(failure, _SSL_CUT):
        return None
    return str(failure.reason or "SSL error")


def _gateway_error(error: etcd_errors.Etcd3Exception) -> tuple[int | None, str]:
    """gRPC code and message of an error body of etcd's gateway (None, text when not JSON)."""
    text = error.detail_text or ""
    try:
        body = json.loads(text)
    except (TypeError, ValueError):
        return None, text.strip()[:200]
    if not isinstance(body, dict):
        return None, text.strip()[:200]
    code = body.get("code")
    message = body.get("error") or body.get("message") or text
    return (code if isinstance(code, int) else None), str(message).strip()[:200]


def transient_reason(error: BaseException) -> str | None:
    """Why `error` may pass if the request is sent again; None when no retry can fix it."""
    if not isinstance(error, etcd_errors.Etcd3Exception):
        return None
    if tls_refusal(error) is not None:
        return None
    code, message = _gateway_error(error)
    if isinstance(error, etcd_errors.ConnectionTimeoutError):
        return f"no answer in time ({message or 'timeout'})"
    if isinstance(error, etcd_errors.ConnectionFailedError):
        return f"connection failed ({message or 'refused or reset'})"
    if isinstance(error, etcd_errors.InternalServerError):
        return f"etcd internal error ({message})"
    if code in _TRANSIENT_GRPC:
        return f"etcd {_TRANSIENT_GRPC[code]} ({message})"
    return None


def retry(
    attempt: Callable[[float], T],
    policy: RetryPolicy,
    what: str,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    rand: Callable[[], float] = random.random,
    transient: Callable[[BaseException], str | None] = transient_reason,
) -> T:
    """`attempt(timeout_s)`'s result, sending it again after transient failures.

    A failure `transient` cannot name is raised as it is, at once. When the deadline passes,
    StoreError says what was tried, for how long, how often and the last reason.
    """
    start = clock()
    deadline = start + policy.deadline_s
    number = 0
    while True:
        number += 1
        try:
            return attempt(policy.attempt_timeout_s(deadline - clock()))
        except Exception as e:
            reason = transient(e)
            if reason is None:
                raise
            now = clock()
            wait = min(policy.backoff_s(number, rand), deadline - now)
            if wait <= 0:
                raise StoreError(
                    f"{what}: gave up after {now - start:.1f} s and {number} attempt"
                    f"{'' if number == 1 else 's'} "
                    f"(deadline {policy.deadline_s:g} s); last failure: {reason}"
                ) from e
            log.debug("%s: attempt %d failed (%s); again in %.2f s", what, number, reason, wait)
            sleep(wait)
