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

import socket
import threading
import time

from transom.checkpoint.protocol import ProtocolError, ProtocolTimeout, recv_msg, send_msg

CONNECT_TIMEOUT_S = 10.0
# A request to the node's checkpoint server gives up after this many seconds without its reply.
REQUEST_TIMEOUT_S = 30.0


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says why."""


class RequestTimeout(CheckpointError):
    """The node's checkpoint server did not answer a request in time."""


class ServerConnection:
    def __init__(self, socket_path: str, timeout_s: float = REQUEST_TIMEOUT_S):
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

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

    def request(self, msg: dict, fresh: bool = False, timeout: float | None = None) -> dict:
        """The reply to `msg` within `timeout` s (default: timeout_s), RequestTimeout past it;
        CheckpointError when the server cannot be reached."""
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        late = f"no answer to {msg.get('op')!r} from the checkpoint server within {limit:g} s"
        if fresh:
            sock = self._connect(deadline)
            try:
                send_msg(sock, msg, deadline)
                return recv_msg(sock, deadline)
            except ProtocolTimeout as e:
                raise RequestTimeout(late) from e
            except (ProtocolError, OSError) as e:
                raise CheckpointError(f"checkpoint server connection lost: {e}") from e
            finally:
                sock.close()
        if not self._lock.acquire(timeout=limit):
            raise RequestTimeout(f"{late} (an earlier request is still waiting)")
        try:
            for attempt in (0, 1):
                if self._sock is None:
                    self._sock = self._connect(deadline)
                try:
                    send_msg(self._sock, msg, deadline)
                    return recv_msg(self._sock, deadline)
                except (ProtocolError, OSError) as e:
                    self._sock.close()  # a late reply must not answer the next request
                    self._sock = None
                    if isinstance(e, ProtocolTimeout):
                        raise RequestTimeout(late) from e
                    if attempt or msg.get("op") == "commit":
                        raise CheckpointError(f"checkpoint server connection lost: {e}") from e
        finally:
            self._lock.release()
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
