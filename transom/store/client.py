"""`Store`: the job's view of etcd, with JSON values under one key prefix per job.

Every key of a job lives under /transom/<job-id>/; the key names and what each holds are
defined once in transom.common.keys, the values' shapes in transom.common.records.

How it reaches etcd (URL, TLS files) is a `StoreAccess` (access.py).

Writes that only the leader may make go through `put_if_leader`, a transaction that compares
the leader key, so a deposed controller cannot overwrite its successor's decisions.
"""

from __future__ import annotations

import json
import ssl
import time
from typing import Any

from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import Etcd3Client
from etcd3gw.lease import Lease
from etcd3gw.utils import _encode

from transom.common import keys
from transom.store.access import FLAG_CA, FLAG_CERT, FLAG_KEY, StoreAccess, StoreError

REQUEST_TIMEOUT_S = 5.0


def _text(path: object) -> str | None:
    return None if path is None else str(path)


def _tls_failure(error: BaseException) -> str | None:
    """The reason of the TLS error behind `error` (etcd3gw wraps requests' errors), if any."""
    seen: BaseException | None = error
    for _ in range(16):  # a chain is short; this bounds a cyclic one
        if seen is None:
            break
        if isinstance(seen, ssl.SSLError):
            return str(seen.reason or "SSL error")
        seen = seen.__cause__ or seen.__context__
    return None


class Store:
    """JSON key-value access to one job's keys in etcd.

    `access` is a `StoreAccess` (URL and TLS files) or, for plain http, just the URL.
    """

    def __init__(self, access: StoreAccess | str, job_id: str, timeout: float = REQUEST_TIMEOUT_S):
        self.access = access if isinstance(access, StoreAccess) else StoreAccess(access)
        self.url = self.access.url
        self.job_id = job_id
        self.client = Etcd3Client(
            host=self.access.host,
            port=self.access.port,
            protocol=self.access.scheme,
            ca_cert=_text(self.access.ca),
            cert_cert=_text(self.access.cert),
            cert_key=_text(self.access.key),
            timeout=timeout,
        )
        if self.access.ca is not None:
            # requests lets REQUESTS_CA_BUNDLE (and proxies) from the environment override the
            # session's CA: with a CA of its own the store takes nothing from the environment.
            self.client.session.trust_env = False
        self.prefix = f"/transom/{job_id}/"

    # -- keys -------------------------------------------------------------------------------
    def key(self, name: str) -> str:
        return self.prefix + name

    # -- plain access -----------------------------------------------------------------------
    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError) as e:
            reason = _tls_failure(e)
            if reason is not None:  # a certificate was refused: ours by etcd, or etcd's by us
                raise StoreError(
                    f"cannot reach etcd at {self.url}: the TLS handshake failed ({reason}; "
                    f"check {FLAG_CA}, {FLAG_CERT} and {FLAG_KEY})"
                ) from e
            raise StoreError(f"cannot reach etcd at {self.url}: {type(e).__name__}") from e
        except etcd_errors.Etcd3Exception as e:
            raise StoreError(f"etcd at {self.url} refused a request: {e}") from e

    def healthy(self) -> bool:
        try:
            self.client.status()
            return True
        except Exception:  # noqa: BLE001 - any failure means "not usable now"
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() > deadline:
                self._call(self.client.status)  # raises the reason (e.g. a refused certificate)
                raise StoreError(f"cannot reach etcd at {self.url}")
            time.sleep(0.2)

    def get(self, name: str) -> Any | None:
        values = self._call(self.client.get, self.key(name))
        return json.loads(values[0]) if values else None

    def wait_for(self, name: str, timeout_s: float, poll_s: float = 0.2) -> Any:
        """The value of `name` once it exists; StoreError if it does not appear in `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (value := self.get(name)) is None:
            if time.monotonic() > deadline:
                raise StoreError(f"job {self.job_id} has no {name} in etcd after {timeout_s:.0f} s")
            time.sleep(poll_s)
        return value

    def get_prefix(self, name: str) -> dict[str, Any]:
        """Values under `name` keyed by the rest of their key, in key order."""
        start = self.key(name)
        items = self._call(self.client.get_prefix, start, sort_order="ascend", sort_target="key")
        return {meta["key"].decode()[len(start) :]: json.loads(value) for value, meta in items}

    def put(self, name: str, value: Any, lease: Lease | None = None) -> None:
        self._call(self.client.put, self.key(name), json.dumps(value), lease)

    def create(self, name: str, value: Any, lease: Lease | None = None) -> bool:
        """Write `name` only if it does not exist; True when this call created it."""
        return bool(self._call(self.client.create, self.key(name), json.dumps(value), lease))

    def delete(self, name: str) -> None:
        self._call(self.client.delete, self.key(name))

    def delete_prefix(self, name: str) -> None:
        self._call(self.client.delete_prefix, self.key(name))

    def delete_job(self) -> None:
        self._call(self.client.delete_prefix, self.prefix)

    def lease(self, ttl_s: int) -> Lease:
        return self._call(self.client.lease, ttl_s)

    def refresh(self, lease: Lease) -> bool:
        """Keep a lease alive; False when it has already expired."""
        return self._call(lease.refresh) > 0

    def revoke(self, lease: Lease) -> None:
        self._call(lease.revoke)

    # -- fenced writes ----------------------------------------------------------------------
    def put_if_leader(self, leader_id: str, values: dict[str, Any]) -> bool:
        """Write all `values` in one transaction, only while `leader` still holds `leader_id`."""
        txn = {
            "compare": [
                {
                    "key": _encode(self.key(keys.LEADER)),
                    "result": "EQUAL",
                    "target": "VALUE",
                    "value": _encode(json.dumps(leader_id)),
                }
            ],
            "success": [
                {
                    "request_put": {
                        "key": _encode(self.key(name)),
                        "value": _encode(json.dumps(value)),
                    }
                }
                for name, value in values.items()
            ],
            "failure": [],
        }
        return bool(self._call(self.client.transaction, txn).get("succeeded", False))
