"""A TCP proxy in front of etcd that a test or the torture suite controls: pass, blackhole, delay.

One `StoreProxy` listens on a free loopback port and forwards every connection to etcd byte for
byte (TLS passes through untouched: the client still authenticates etcd and itself end to end).
The harness points one node's processes (its agent and, through the agent, its checkpoint
server) at its own proxy, so it can cut that node off from etcd while every other node and the
controllers keep their way in, or make the whole store slow:
  pass       forward as is
  blackhole  a network partition: bytes are read and dropped in both directions, new connections
             are accepted and then never answered (clients see timeouts, not refusals)
  delay      every chunk a client sends is held `delay_s` before it is forwarded (in order), so
             each request takes at least that long to be answered

It is part of the test harness: it never starts or stops etcd or any process of a job.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque

CHUNK = 65536


class StoreProxy:
    def __init__(self, target_host: str, target_port: int, name: str = ""):
        self.target = (target_host, target_port)
        self.name = name
        self.mode = "pass"
        self.delay_s = 0.0
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name=f"proxy-{name}", daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    # -- control ------------------------------------------------------------------------------
    def set_pass(self) -> None:
        self.mode, self.delay_s = "pass", 0.0

    def set_blackhole(self) -> None:
        self.mode = "blackhole"

    def set_delay(self, seconds: float) -> None:
        self.delay_s, self.mode = seconds, "delay"

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for s in list(self._sockets):
                _close(s)
            self._sockets.clear()

    # -- forwarding ---------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._sockets.update((client, upstream))
            for src, dst, delayed in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(
                    target=self._pump, args=(src, dst, delayed), daemon=True, name="proxy-pump"
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delayed: bool) -> None:
        """Copy src -> dst; requests (client -> etcd) are the direction that `delay` holds."""
        pending: deque[tuple[float, bytes]] = deque()
        ready = threading.Condition()
        done = threading.Event()

        def deliver() -> None:
            while True:
                with ready:
                    while not pending and not done.is_set():
                        ready.wait(0.5)
                    if not pending:
                        return
                    due, data = pending[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(min(wait, 0.2))
                    continue
                with ready:
                    pending.popleft()
                try:
                    dst.sendall(data)
                except OSError:
                    return

        sender = threading.Thread(target=deliver, daemon=True, name="proxy-deliver")
        sender.start()
        try:
            while True:
                try:
                    data = src.recv(CHUNK)
                except OSError:
                    break
                if not data:
                    break
                if self.mode == "blackhole":
                    continue  # dropped, like a partition drops packets
                due = time.monotonic() + (self.delay_s if delayed and self.mode == "delay" else 0)
                with ready:
                    pending.append((due, data))
                    ready.notify()
        finally:
            done.set()
            with ready:
                ready.notify()
            sender.join(timeout=30)
            for s in (src, dst):
                _close(s)
                with self._lock:
                    self._sockets.discard(s)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
