"""`GatewayClient`: etcd3gw's client of etcd's HTTP gateway, its requests on kept connections.

etcd3gw builds every request on a `requests` session: per request, that session merges
settings, prepares headers and cookies and picks an adapter. Every node sends one to two
requests a second for as long as the job runs, and a 1,024-node job's agents thousands at a
restart, so `post`, the one method every unary request of etcd3gw goes through (put, range,
transaction, lease grant, keep-alive, revoke), sends them over the standard library's
`http.client` connections instead, kept open between requests (`KeptConnections`): a small
put costs the client 0.5-0.8 ms of CPU this way, against 0.7-1.1 ms through a urllib3 pool
and more through the session (alternating runs, 500 puts 5 ms apart). Same TLS files,
timeouts and errors:
  - connect or read timeout: ConnectionTimeoutError; refused, reset, TLS failure, a malformed
    answer, anything else on the way: ConnectionFailedError, with the cause chained (the retry
    policy finds a refused certificate there); an HTTP error status: what etcd3gw raises for it.
  - the time limit of each request is per thread (`attempt`), so each attempt of a retried
    call gets its own while other threads use the same client.
  - a connection is used by one request at a time; one that failed, or that the server closed
    while it was idle, is dropped, never reused.
The watch streams (watch.py) still use etcd3gw's session: one long request each, whose cost
is in its events, not in setting it up.

Neither path takes anything from the environment (proxies, a CA bundle): etcd is reached
directly, and its certificate checked against the given CA or, without one, requests' bundle.
This module must never send a request without the time limit, or over https without checking
etcd's certificate and host name.
"""

from __future__ import annotations

import http.client
import json
import select
import ssl
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import requests
from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import _EXCEPTIONS_BY_CODE, Etcd3Client

T = TypeVar("T")

KEPT_CONNECTIONS = 4  # idle connections kept per client: its owner's threads seldom send more
_HEADERS = {"Content-Type": "application/json"}


class KeptConnections:
    """Connections to one server, kept open between requests: `take` one (an idle one the
    server has not closed, or a new one), send a request, `give_back` it when its answer was
    read whole (at most `keep` stay idle), `close` everything idle."""

    def __init__(self, connect: Callable[[], http.client.HTTPConnection], keep: int):
        self._connect = connect
        self._keep = keep
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def take(self) -> http.client.HTTPConnection:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect()
            if not _closed_by_server(conn):
                return conn
            conn.close()

    def give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self._keep:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _closed_by_server(conn: http.client.HTTPConnection) -> bool:
    """An idle connection with something to read has been closed (or spoken on out of turn)."""
    if conn.sock is None:
        return True
    poll = select.poll()
    poll.register(conn.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poll.poll(0))


class GatewayClient(Etcd3Client):
    """etcd3gw's client of `protocol://host:port` with kept connections under its unary requests.

    `ca_cert`, `cert_cert`, `cert_key` (paths or None) and `timeout` mean what they mean to
    etcd3gw; `api_path` should be given ("/v3/" for etcd >= 3.4) so that no discovery request
    precedes the first real one."""

    def __init__(self, **kwargs: Any):
        self._attempt = threading.local()
        super().__init__(**kwargs)
        self.session.trust_env = False
        self.tls: ssl.SSLContext | None = None  # certificate and host name checked
        if self.protocol == "https":
            ca = kwargs.get("ca_cert") or requests.certs.where()
            self.tls = ssl.create_default_context(cafile=ca)
            if kwargs.get("cert_cert"):
                self.tls.load_cert_chain(kwargs["cert_cert"], kwargs.get("cert_key"))
        self.connections = KeptConnections(self._connect, KEPT_CONNECTIONS)

    def _connect(self) -> http.client.HTTPConnection:
        if self.tls is None:
            return http.client.HTTPConnection(self.host, self.port)
        return http.client.HTTPSConnection(self.host, self.port, context=self.tls)

    @property
    def timeout(self) -> float | None:
        return getattr(self._attempt, "timeout_s", None) or self._default_timeout_s

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._default_timeout_s = value

    def attempt(self, timeout_s: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` with every request it sends limited to `timeout_s` seconds."""
        self._attempt.timeout_s = timeout_s
        try:
            return fn(*args, **kwargs)
        finally:
            self._attempt.timeout_s = None

    def post(
        self, url: str, *args: Any, json: Any = None, data: str | None = None, **kwargs: Any
    ) -> Any:
        """etcd's answer (decoded JSON) to `json` (or `data`, JSON already encoded: etcd3gw's
        transactions) posted at `url` (a URL of `get_url`)."""
        if args or kwargs or not url.startswith(self.base_url) or (json and data):
            return super().post(url, *args, json=json, data=data, **kwargs)
        body = data.encode() if data is not None else _dumps(json)
        conn = self.connections.take()
        conn.timeout = self.timeout  # connecting, and every read and write after it
        try:
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            conn.request("POST", url[len(self.base_url) :], body=body, headers=_HEADERS)
            response = conn.getresponse()
            answer = response.read()
        except TimeoutError as e:  # socket.timeout, connecting or waiting for the answer
            conn.close()
            raise etcd_errors.ConnectionTimeoutError(str(e) or "timed out") from e
        except (OSError, http.client.HTTPException) as e:  # refused, reset, TLS, malformed
            conn.close()
            raise etcd_errors.ConnectionFailedError(str(e) or type(e).__name__) from e
        if response.will_close:
            conn.close()
        else:
            self.connections.give_back(conn)
        if response.status != 200:
            text = answer.decode(errors="replace")
            error = _EXCEPTIONS_BY_CODE.get(response.status, etcd_errors.Etcd3Exception)
            raise error(text, response.reason)
        return _loads(answer)

    def close(self) -> None:
        """Close its connections (the kept ones and the session's)."""
        self.connections.close()
        self.session.close()


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def _loads(data: bytes) -> Any:
    return json.loads(data)
