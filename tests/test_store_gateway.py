"""The gateway client's own requests (transom.store.gateway): what a failure becomes, and what it
takes from the environment. Against small local HTTP servers; the real etcd paths (TLS refused,
stalls, restarts) are in test_store.py and test_store_resilience.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from etcd3gw import exceptions as etcd_errors

from transom.store import Store, StoreError
from transom.store.gateway import GatewayClient
from transom.utils.net import free_port


def _client(port: int, timeout: float = 2.0) -> GatewayClient:
    return GatewayClient(host="127.0.0.1", port=port, timeout=timeout, api_path="/v3/")


@pytest.fixture
def answering() -> Iterator[tuple[int, list]]:
    """An HTTP server on loopback whose answer is the (status, body) last put in its list;
    every request's (path, JSON body) is appended to that list too."""
    answers: list = [(200, {"ok": True})]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            length = int(self.headers["Content-Length"])
            answers.append((self.path, json.loads(self.rfile.read(length))))
            status, body = next(a for a in reversed(answers) if isinstance(a[0], int))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], answers
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def keeping() -> Iterator[tuple[int, list, threading.Event]]:
    """An HTTP/1.1 server on loopback that answers {"ok": true} and keeps the connection open,
    appending each request's client port to its list; when that list holds "close", it closes
    each connection after answering (without saying so), then sets its event."""
    ports: list = []
    closed = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            ports.append(self.client_address[1])
            self.send_response(200)
            self.send_header("Content-Length", "12")
            self.end_headers()
            self.wfile.write(b'{"ok": true}')
            self.close_connection = "close" in ports

        def log_message(self, *args) -> None:
            pass

    class Server(ThreadingHTTPServer):
        def shutdown_request(self, request) -> None:
            super().shutdown_request(request)
            closed.set()

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], ports, closed
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_requests_one_after_another_reuse_one_connection(keeping):
    port, ports, _ = keeping
    client = _client(port)
    try:
        for _ in range(3):
            assert client.post(client.get_url("kv/put"), json={}) == {"ok": True}
        assert len(ports) == 3 and len(set(ports)) == 1
    finally:
        client.close()


def test_a_connection_the_server_closed_while_idle_is_not_reused(keeping):
    """Sent on a connection the server had closed, the request would fail; it goes on a new one."""
    port, ports, closed = keeping
    ports.append("close")
    client = _client(port)
    try:
        assert client.post(client.get_url("kv/put"), json={}) == {"ok": True}
        assert closed.wait(timeout=10)  # the server closed the connection the client kept
        assert client.post(client.get_url("kv/put"), json={}) == {"ok": True}
        assert ports[1] != ports[2]
    finally:
        client.close()


def test_a_request_posts_json_and_returns_the_answer(answering):
    port, answers = answering
    client = _client(port)
    try:
        assert client.post(client.get_url("kv/put"), json={"key": "a2V5"}) == {"ok": True}
        assert answers[-1] == ("/v3/kv/put", {"key": "a2V5"})
    finally:
        client.close()


def test_a_transaction_goes_through_the_pool_not_the_session(answering, monkeypatch):
    """etcd3gw posts a transaction as `data=` (JSON it encoded): that is a unary request too."""
    port, answers = answering
    client = _client(port)

    def no_session(*args, **kwargs):
        raise AssertionError("a unary request went through the requests session")

    monkeypatch.setattr(client.session, "post", no_session)
    try:
        txn = {"compare": [], "success": [], "failure": []}
        assert client.transaction(txn) == {"ok": True}
        assert answers[-1] == ("/v3/kv/txn", txn)
    finally:
        client.close()


@pytest.mark.parametrize(
    "status, error",
    [
        (503, etcd_errors.ConnectionFailedError),
        (504, etcd_errors.ConnectionTimeoutError),
        (500, etcd_errors.InternalServerError),
        (400, etcd_errors.Etcd3Exception),
    ],
)
def test_an_error_status_is_what_etcd3gw_raises_for_it(answering, status, error):
    port, answers = answering
    answers.append((status, {"error": "no", "code": 3}))
    client = _client(port)
    try:
        with pytest.raises(error) as raised:
            client.post(client.get_url("kv/range"), json={})
        assert type(raised.value) is error and '"code": 3' in (raised.value.detail_text or "")
    finally:
        client.close()


def test_a_refused_connection_fails_and_a_silent_server_times_out():
    client = _client(free_port(), timeout=0.5)
    try:
        with pytest.raises(etcd_errors.ConnectionFailedError):
            client.post(client.get_url("kv/range"), json={})
    finally:
        client.close()
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        client = _client(silent.getsockname()[1], timeout=10.0)
        try:
            started = time.monotonic()
            with pytest.raises(etcd_errors.ConnectionTimeoutError):
                client.attempt(0.5, client.post, client.get_url("kv/range"), json={})
            assert time.monotonic() - started < 5.0  # the attempt's limit, not the default
        finally:
            client.close()


def test_no_proxy_of_the_environment_is_used(answering, monkeypatch):
    port, _ = answering
    dead = f"http://127.0.0.1:{free_port()}"
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, dead)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    store = Store(f"http://127.0.0.1:{port}", "j", timeout=1.0, deadline_s=1.0)
    try:
        assert store.request("maintenance/status", {}) == {"ok": True}
        assert store.client.session.trust_env is False  # nor by the watch streams
    finally:
        store.client.close()


def test_a_bad_answer_through_the_store_is_a_refusal_not_a_crash(answering):
    port, answers = answering
    answers.append((400, {"error": "etcdserver: bad", "code": 3}))
    store = Store(f"http://127.0.0.1:{port}", "j", timeout=1.0, deadline_s=1.0)
    try:
        with pytest.raises(StoreError, match="refused a request"):
            store.put("a", 1)
    finally:
        store.client.close()
