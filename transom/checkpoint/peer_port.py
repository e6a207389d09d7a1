"""The checkpoint server's TCP port for peers: accept, admit at most a few at once, hand off.

One thread accepts. A connection is admitted while fewer than MAX_PEER_CONNECTIONS are being
served, and gets a thread that runs `serve(sock)` (peer_service.py: authenticate within
AUTH_TIMEOUT_S, one request, every read with a deadline), then closes it. Beyond the cap a new
connection is closed at once, counted, and logged at most once every LOG_INTERVAL_S; when the
process is out of file descriptors, the accept loop backs off instead of spinning. So a flood
of idle, slow or malformed connections costs at most MAX_PEER_CONNECTIONS threads and sockets
for at most AUTH_TIMEOUT_S each, and never delays the workers' socket.

This module never reads or writes a connection's bytes; `serve` never raises out of it.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger("transom.ckpt.server")

MAX_PEER_CONNECTIONS = 32
LOG_INTERVAL_S = 60.0
# The accept loop looks at its stop flag this often.
ACCEPT_POLL_S = 0.5
# After accept fails for want of file descriptors or memory, wait this long before the next.
ACCEPT_BACKOFF_S = 0.05
OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class Throttle:
    """Lets a report through at most once every `interval_s` and counts what it held back."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self.last = -float("inf")
        self.held = 0

    def hit(self) -> int | None:
        """Count one occurrence; the number of occurrences since the last report (this one
        included) when it is time to report, else None."""
        with self.lock:
            self.held += 1
            now = time.monotonic()
            if now - self.last < self.interval_s:
                return None
            self.last, count, self.held = now, self.held, 0
            return count


class PeerPort:
    """A listening TCP socket whose connections are served by `serve`, at most
    `max_connections` at once."""

    def __init__(
        self,
        host: str,
        port: int,
        serve: Callable[[socket.socket], None],
        max_connections: int = MAX_PEER_CONNECTIONS,
    ):
        self.serve = serve
        self.max_connections = max_connections
        self.listener = socket.create_server((host, port), backlog=socket.SOMAXCONN)
        self.listener.settimeout(ACCEPT_POLL_S)
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.active: set[socket.socket] = set()
        self.refused = 0  # connections closed at once because the cap was reached
        self.failed = 0  # connections whose serve raised
        self._cap_log = Throttle()
        self._error_log = Throttle()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PeerPort:
        self._thread = threading.Thread(
            target=self._accept_loop, name="ckpt-peer-port", daemon=True
        )
        self._thread.start()
        return self

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stopping.is_set():
                    return
                if e.errno in OUT_OF_RESOURCES:
                    count = self._error_log.hit()
                    if count:
                        log.warning("peer port: cannot accept (%s), %d times", e, count)
                    time.sleep(ACCEPT_BACKOFF_S)
                continue
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        with self.lock:
            full = len(self.active) >= self.max_connections
            if full:
                self.refused += 1
            else:
                self.active.add(conn)
        if full:
            conn.close()
            count = self._cap_log.hit()
            if count:
                log.warning(
                    "peer port at its cap of %d connections: closed %d new connection(s) since "
                    "the last report (%d in all)",
                    self.max_connections,
                    count,
                    self.refused,
                )
            return
        try:
            threading.Thread(target=self._run, args=(conn,), name="ckpt-peer", daemon=True).start()
        except RuntimeError as e:  # no thread to be had: like a full port
            self._release(conn)
            log.warning("peer port: cannot start a thread for a connection: %s", e)

    def _run(self, conn: socket.socket) -> None:
        try:
            self.serve(conn)
        except Exception as e:  # noqa: BLE001 - one bad connection must not end the others
            with self.lock:
                self.failed += 1
            count = self._error_log.hit()
            if count:
                log.warning("peer connection failed (%d since the last report): %r", count, e)
        finally:
            self._release(conn)

    def _release(self, conn: socket.socket) -> None:
        with self.lock:
            self.active.discard(conn)
        conn.close()

    def connections(self) -> int:
        """Connections being served now."""
        with self.lock:
            return len(self.active)

    def close(self) -> None:
        """Stop accepting and cut every connection being served."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        self.listener.close()
        with self.lock:
            active = list(self.active)
        for conn in active:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes its thread, which closes it
            except OSError:
                pass
