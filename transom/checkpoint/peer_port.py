"""The checkpoint server's TCP port for peers: authenticate without a thread, then serve a few.

One thread runs a selector over the listening socket and every connection that has not yet
proved it holds the job's secret (the mutual HMAC challenge, protocol.ServerHandshake): those
cost a socket and a few bytes each, never a thread. Their number is capped twice: at most
MAX_PENDING_PER_ADDRESS from one remote address and MAX_PENDING_AUTH in all; a new connection
beyond a cap makes the oldest pending one of the busiest address give way (closed), so a flood
of idle or slow connections only ever evicts itself, and a peer that answers its challenge at
once (a replication: a few milliseconds) always gets through, however many connections others
hold open. A pending connection not proved within AUTH_TIMEOUT_S is closed; a wrong proof is
reported (throttled, `on_auth_failed`) and closed.

A proved connection gets a thread that runs `serve(sock)` (peer_service.py: one request, every
read with a deadline), at most MAX_PEER_CONNECTIONS at once: only peers holding the secret can
take those. Beyond that cap it is closed at once, counted and logged at most once every
LOG_INTERVAL_S; when the process is out of file descriptors, accepting backs off instead of
spinning. So threads stay at 1 + MAX_PEER_CONNECTIONS and memory at a few hundred small
sockets, and none of it ever delays the workers' socket.

This module never reads a connection's bytes past its proof; `serve` never raises out of it.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transom.checkpoint.protocol import AUTH_TIMEOUT_S, AuthError, ServerHandshake, send_at_once

log = logging.getLogger("transom.ckpt.server")

MAX_PEER_CONNECTIONS = 32  # proved connections served at once (a thread each)
MAX_PENDING_AUTH = 256  # connections not proved yet, in all
MAX_PENDING_PER_ADDRESS = 64  # of those, from one remote address
ACCEPTS_PER_ROUND = 16  # so handshakes under way progress between a flood's arrivals
LOG_INTERVAL_S = 60.0
# The selector wakes this often at least (to see its stop flag and pending deadlines).
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


@dataclass(eq=False)
class Pending:
    """A connection whose peer has not proved it holds the secret yet."""

    sock: socket.socket
    address: str
    deadline: float
    handshake: ServerHandshake
    since: float = field(default_factory=time.monotonic)


class PeerPort:
    """A listening TCP socket whose proved connections are served by `serve`, at most
    `max_connections` at once."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        serve: Callable[[socket.socket], None],
        on_auth_failed: Callable[[socket.socket, AuthError], None] | None = None,
        max_connections: int = MAX_PEER_CONNECTIONS,
        max_pending: int = MAX_PENDING_AUTH,
        max_pending_per_address: int = MAX_PENDING_PER_ADDRESS,
    ):
        self.secret = secret
        self.serve = serve
        self.on_auth_failed = on_auth_failed
        self.max_connections = max_connections
        self.max_pending = max_pending
        self.max_pending_per_address = max_pending_per_address
        self.listener = socket.create_server((host, port), backlog=socket.SOMAXCONN)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.active: set[socket.socket] = set()
        self.pending: dict[socket.socket, Pending] = {}  # the selector thread's own
        self.refused = 0  # proved connections closed at once because the cap was reached
        self.evicted = 0  # pending connections closed to make room for newer ones
        self.failed = 0  # connections whose serve raised
        self._cap_log = Throttle()
        self._evict_log = Throttle()
        self._error_log = Throttle()
        self._selector = selectors.DefaultSelector()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PeerPort:
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="ckpt-peer-port", daemon=True)
        self._thread.start()
        return self

    # -- the selector thread -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                soonest = min((p.deadline for p in self.pending.values()), default=None)
                wait = (
                    ACCEPT_POLL_S
                    if soonest is None
                    else max(0.0, min(ACCEPT_POLL_S, soonest - now))
                )
                for key, _ in self._selector.select(wait):
                    if key.fileobj is self.listener:
                        self._accept_some()
                    elif isinstance(key.fileobj, socket.socket) and key.fileobj in self.pending:
                        self._advance(self.pending[key.fileobj])
                self._expire(time.monotonic())
        finally:
            for pending in list(self.pending.values()):
                self._drop(pending)
            self._selector.close()

    def _accept_some(self) -> None:
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                conn, addr = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in OUT_OF_RESOURCES:
                    count = self._error_log.hit()
                    if count:
                        log.warning("peer port: cannot accept (%s), %d times", e, count)
                    time.sleep(ACCEPT_BACKOFF_S)
                return
            self._greet(conn, str(addr[0]) if isinstance(addr, tuple) else str(addr))

    def _greet(self, conn: socket.socket, address: str) -> None:
        """Challenge a new connection, making room among the pending ones first."""
        self._make_room(address)
        pending = Pending(
            conn, address, time.monotonic() + AUTH_TIMEOUT_S, ServerHandshake(self.secret)
        )
        try:
            conn.setblocking(False)
            send_at_once(conn)
            conn.send(pending.handshake.greeting())  # a few bytes into an empty buffer
            self._selector.register(conn, selectors.EVENT_READ)
        except OSError:
            conn.close()
            return
        self.pending[conn] = pending

    def _make_room(self, address: str) -> None:
        """Close the oldest pending connection of `address` when it is at its quota, or of the
        address with the most pending connections when all are at theirs."""
        mine = [p for p in self.pending.values() if p.address == address]
        if len(mine) >= self.max_pending_per_address:
            victims = mine
        elif len(self.pending) >= self.max_pending:
            by_address: dict[str, list[Pending]] = {}
            for p in self.pending.values():
                by_address.setdefault(p.address, []).append(p)
            victims = max(by_address.values(), key=len)
        else:
            return
        self._drop(min(victims, key=lambda p: p.since))
        self.evicted += 1
        count = self._evict_log.hit()
        if count:
            log.warning(
                "peer port: %d connection(s) that had not authenticated closed to make room "
                "(%d in all; %d pending now)",
                count,
                self.evicted,
                len(self.pending),
            )

    def _advance(self, pending: Pending) -> None:
        """Read what the handshake wants next; answer; hand the connection on once proved."""
        try:
            data = pending.sock.recv(pending.handshake.wanted())
            if not data:
                self._drop(pending)
                return
            reply = pending.handshake.feed(data)
            if reply:
                pending.sock.send(reply)  # a few bytes: the buffer is empty (we spoke last)
        except AuthError as e:
            if self.on_auth_failed is not None:
                self.on_auth_failed(pending.sock, e)
            self._drop(pending)
            return
        except OSError:  # reset, or would block: an answer we cannot send is a failed one
            self._drop(pending)
            return
        if pending.handshake.done:
            self._selector.unregister(pending.sock)
            del self.pending[pending.sock]
            pending.sock.setblocking(True)
            self._admit(pending.sock)

    def _expire(self, now: float) -> None:
        for pending in [p for p in self.pending.values() if p.deadline <= now]:
            self._drop(pending)

    def _drop(self, pending: Pending) -> None:
        self.pending.pop(pending.sock, None)
        try:
            self._selector.unregister(pending.sock)
        except (KeyError, ValueError):
            pass
        pending.sock.close()

    # -- proved connections --------------------------------------------------------------------
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
                    "peer port at its cap of %d authenticated connections: closed %d since the "
                    "last report (%d in all)",
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
        """Proved connections being served now."""
        with self.lock:
            return len(self.active)

    def close(self) -> None:
        """Stop accepting, drop pending connections and cut every one being served."""
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
