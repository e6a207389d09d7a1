"""A worker's connection to its node's checkpoint server: one request, one reply, in time.

Requests (worker_service.py lists them) share one Unix-socket connection, one at a time; a
request that blocks on purpose (`wait`) or must not queue behind another gets a connection of
its own (`fresh`). Every request has a time limit (REQUEST_TIMEOUT_S unless the caller gives
one), waiting for its turn included: past it `RequestTimeout`, and the shared connection is
closed, so a late reply can never answer the next request (the server gives back whatever the
closed connection had reserved). A lost connection is retried once (never for a `commit`).
This module never decides what a timeout means for a save or a load (engine.py does).
"""

from __future__ import annotations

import collections
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from transom.checkpoint.protocol import ProtocolError, ProtocolTimeout, recv_msg, send_msg
from transom.checkpoint.worker_protocol import Failed, Reply, Request

CONNECT_TIMEOUT_S = 10.0
# A request to the node's checkpoint server gives up after this many seconds without its reply.
REQUEST_TIMEOUT_S = 30.0


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says why."""


# What every rank of a world raises when no step is good for all of them (agreement.py); the
# controller reads it in the workers' logs (control/failures.py, control/policy.py).
LOAD_FAILED = "no step could be loaded by every rank"
# What a rank whose own copies were good says then: its agent counts it as a peer's failure.
PEER_COPIES_BAD = "another rank's copies were bad"


class RequestTimeout(CheckpointError):
    """The node's checkpoint server did not answer a request in time."""


R = TypeVar("R", bound=Reply)
# `send` requests whose replies may wait to be read at once (a save every step sends two: its
# commit and the next step's reservation).
MAX_UNANSWERED = 4
# What reads a `send` request's reply (or the error that stands for it), once it comes.
_Receiver = Callable[[dict[str, Any] | CheckpointError], None]


class ServerConnection:
    def __init__(self, socket_path: str, timeout_s: float = REQUEST_TIMEOUT_S):
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        # How many connections it closed or lost: what one of them reserved is no longer held.
        self.dropped = 0
        # The `send` requests whose replies are still to be read, oldest first: (receiver, op).
        self._unanswered: collections.deque[tuple[_Receiver, str]] = collections.deque()

    def _connect(self, deadline: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(0.001, min(CONNECT_TIMEOUT_S, deadline - time.monotonic())))
        try:
            sock.connect(self.socket_path)
        except OSError as e:
            sock.close()
            raise CheckpointError(
                f"cannot reach the checkpoint server at {self.socket_path}: {e}"
            ) from e
        return sock

    def request(
        self, request: Request[R], fresh: bool = False, timeout: float | None = None
    ) -> R | Failed:
        """The reply to `request` within `timeout` s (default: timeout_s), RequestTimeout past
        it; CheckpointError when the server cannot be reached or its reply is malformed."""
        return _read(request, self._exchange(request.to_msg(), fresh, timeout))

    def _exchange(self, msg: dict[str, Any], fresh: bool, timeout: float | None) -> dict[str, Any]:
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        late = f"no answer to {msg.get('op')!r} from the checkpoint server within {limit:g} s"
        if fresh:
            sock = self._connect(deadline)
            try:
                send_msg(sock, msg, deadline)
                return recv_msg(sock, deadline)
            except (ProtocolError, OSError) as e:
                raise _failure(e, late) from e
            finally:
                sock.close()
        if not self._lock.acquire(timeout=limit):
            raise RequestTimeout(f"{late} (an earlier request is still waiting)")
        try:
            self._settle()
            for attempt in (0, 1):
                if self._sock is None:
                    self._sock = self._connect(deadline)
                try:
                    send_msg(self._sock, msg, deadline)
                    return recv_msg(self._sock, deadline)
                except (ProtocolError, OSError) as e:
                    self._drop()
                    if isinstance(e, ProtocolTimeout) or attempt or msg.get("op") == "commit":
                        raise _failure(e, late) from e
        finally:
            self._lock.release()
        raise AssertionError("unreachable")

    def send(
        self, request: Request[R], on_reply: Callable[[R | Failed | CheckpointError], None]
    ) -> None:
        """Write `request` on the shared connection and return without waiting for its reply,
        which `on_reply` gets later (see the module's docstring), in the thread that reads it;
        it must not make a request on this connection. Replies are read in the order the
        requests were sent; at most MAX_UNANSWERED wait to be read (a send past them reads the
        oldest first). A failure to write, or a reply not read within the time limit once it is
        awaited, reaches `on_reply` as the error request() raises (never retried: the request
        may have reached the server); so does a connection lost before its reply was read."""

        def receive(answer: dict[str, Any] | CheckpointError) -> None:
            if isinstance(answer, CheckpointError):
                return on_reply(answer)
            try:
                reply = _read(request, answer)
            except CheckpointError as e:
                return on_reply(e)
            on_reply(reply)

        msg = request.to_msg()
        limit = self.timeout_s
        deadline = time.monotonic() + limit
        if not self._lock.acquire(timeout=limit):
            receive(
                RequestTimeout(
                    f"{msg.get('op')!r} not sent within {limit:g} s (an earlier "
                    "request is still waiting)"
                )
            )
            return
        try:
            while len(self._unanswered) >= MAX_UNANSWERED:
                self._settle_one(None)
            try:
                if self._sock is None:
                    self._sock = self._connect(deadline)
                send_msg(self._sock, msg, deadline)
            except CheckpointError as e:
                receive(e)
                return
            except (ProtocolError, OSError) as e:
                failure = _failure(e, f"{msg.get('op')!r} not sent within {limit:g} s")
                self._drop(failure)
                receive(failure)
                return
            self._unanswered.append((receive, request.op))
        finally:
            self._lock.release()

    def settle(self, timeout: float | None = None) -> None:
        """Hand over the reply of the `send` request not yet answered, if any. Within `timeout`
        seconds, when shorter than the request time limit (timeout_s): without a reply by then,
        return and leave it unanswered. Otherwise as a request: no reply within the limit is a
        RequestTimeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=self.timeout_s if timeout is None else timeout):
            return
        try:
            self._settle(None if deadline is None else deadline - time.monotonic())
        finally:
            self._lock.release()

    def _settle(self, within: float | None = None) -> None:
        """(Holding the lock.) Hand each unanswered `send` request its reply or error, oldest
        first; see `settle` for `within`."""
        deadline = None if within is None else time.monotonic() + within
        while self._unanswered:
            left = None if deadline is None else deadline - time.monotonic()
            if not self._settle_one(left):
                return

    def _settle_one(self, within: float | None) -> bool:
        """(Holding the lock.) Hand the oldest unanswered `send` request its reply or error;
        False when `within` (shorter than timeout_s) passed first."""
        assert self._sock is not None  # sent on it, and dropped only with its answer
        if within is not None and within < self.timeout_s:
            if not select.select([self._sock], [], [], max(0.0, within))[0]:
                return False
        on_reply, op = self._unanswered.popleft()
        try:
            answer = recv_msg(self._sock, time.monotonic() + self.timeout_s)
        except (ProtocolError, OSError) as e:
            late = f"no answer to {op!r} from the checkpoint server within {self.timeout_s:g} s"
            failure = _failure(e, late)
            on_reply(failure)
            self._drop(failure)  # and the requests sent after it
            return True
        on_reply(answer)
        return True

    def _drop(self, error: CheckpointError | None = None) -> None:
        """Close the shared connection (a late reply must not answer the next request); the
        `send` requests still unanswered get `error` (the connection is lost)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.dropped += 1
        lost = error or CheckpointError("checkpoint server connection closed")
        while self._unanswered:
            on_reply, _ = self._unanswered.popleft()
            on_reply(lost)

    def close(self) -> None:
        """Read the unanswered `send` requests' replies, then disconnect."""
        with self._lock:
            self._settle()
            self._drop()


def _read(request: Request[R], msg: dict[str, Any]) -> R | Failed:
    """The reply to `request` in the server's message; CheckpointError when it is malformed."""
    try:
        return request.read_reply(msg)
    except ValueError as e:
        raise CheckpointError(f"bad reply to {request.op!r} from the checkpoint server: {e}") from e


def _failure(error: ProtocolError | OSError, late: str) -> CheckpointError:
    """What a failed exchange on a connection means to the caller: a timeout or a lost server."""
    if isinstance(error, ProtocolTimeout):
        return RequestTimeout(late)
    return CheckpointError(f"checkpoint server connection lost: {error}")
