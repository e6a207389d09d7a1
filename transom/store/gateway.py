"""`GatewayClient`: etcd3gw's client of etcd's HTTP gateway, its requests sent through urllib3.

etcd3gw builds every request on a `requests` session: per request, that session merges
settings, prepares headers and cookies and picks an adapter, about half of the client's CPU
time for a small put (1.5 ms a request on this machine). Every node sends one to two requests a
second for as long as the job runs, so `post`, the one method every unary request of etcd3gw
goes through (put, range, transaction, lease grant, keep-alive, revoke), sends them through a
urllib3 connection pool of its own instead, with the same TLS files, timeouts and errors:
  - connect or read timeout: ConnectionTimeoutError; refused, reset, TLS failure, anything
    else on the way: ConnectionFailedError, with the cause chained (the retry policy finds a
    refused certificate there); an HTTP error status: what etcd3gw raises for it.
  - the time limit of each request is per thread (`attempt`), so each attempt of a retried
    call gets its own while other threads use the same client.
The watch streams (watch.py) still use etcd3gw's session: one long request each, whose cost
is in its events, not in setting it up.

Neither path takes anything from the environment (proxies, a CA bundle): etcd is reached
directly, and its certificate checked against the given CA or, without one, requests' bundle.
This module must never send a request without the time limit, or over https without checking
etcd's certificate.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import requests
import urllib3
from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import _EXCEPTIONS_BY_CODE, Etcd3Client
from urllib3 import exceptions as http_errors

T = TypeVar("T")

POOL_SIZE = 4  # connections kept per client: its owner's threads seldom send more at once
_HEADERS = {"Content-Type": "application/json"}


class GatewayClient(Etcd3Client):
    """etcd3gw's client of `protocol://host:port` with urllib3 under its unary requests.

    `ca_cert`, `cert_cert`, `cert_key` (paths or None) and `timeout` mean what they mean to
    etcd3gw; `api_path` should be given ("/v3/" for etcd >= 3.4) so that no discovery request
    precedes the first real one."""

    def __init__(self, **kwargs: Any):
        self._attempt = threading.local()
        super().__init__(**kwargs)
        self.session.trust_env = False
        ca = kwargs.get("ca_cert") or requests.certs.where()
        pool: urllib3.HTTPConnectionPool
        if self.protocol == "https":
            pool = urllib3.HTTPSConnectionPool(
                self.host,
                self.port,
                maxsize=POOL_SIZE,
                cert_reqs="CERT_REQUIRED",
                ca_certs=ca,
                cert_file=kwargs.get("cert_cert"),
                key_file=kwargs.get("cert_key"),
            )
        else:
            pool = urllib3.HTTPConnectionPool(self.host, self.port, maxsize=POOL_SIZE)
        self.pool = pool

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
        limit = self.timeout
        try:
            response = self.pool.urlopen(
                "POST",
                url[len(self.base_url) :],
                body=body,
                headers=_HEADERS,
                timeout=urllib3.Timeout(connect=limit, read=limit),
                retries=False,
                redirect=False,
            )
        except http_errors.NewConnectionError as e:  # a subclass of the timeout, but refused
            raise etcd_errors.ConnectionFailedError(str(e)) from e
        except http_errors.TimeoutError as e:
            raise etcd_errors.ConnectionTimeoutError(str(e)) from e
        except http_errors.HTTPError as e:
            raise etcd_errors.ConnectionFailedError(str(e)) from e
        if response.status != 200:
            text = response.data.decode(errors="replace")
            error = _EXCEPTIONS_BY_CODE.get(response.status, etcd_errors.Etcd3Exception)
            raise error(text, response.reason)
        return _loads(response.data)

    def close(self) -> None:
        """Close its connections (the pool's and the session's)."""
        self.pool.close()
        self.session.close()


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def _loads(data: bytes) -> Any:
    return json.loads(data)
