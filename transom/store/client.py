"""`Store`: the job's view of etcd, with JSON values under one key prefix per job.

Every key of a job lives under /transom/<job-id>/; the key names and what each holds are
defined once in transom.common.keys, the values' shapes in transom.common.records.

Writes that only the leader may make go through `put_if_leader`, a transaction that compares
the leader key, so a deposed controller cannot overwrite its successor's decisions.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlparse

from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import Etcd3Client
from etcd3gw.lease import Lease
from etcd3gw.utils import _encode

from transom.common import keys

REQUEST_TIMEOUT_S = 5.0


class StoreError(RuntimeError):
    """etcd cannot be reached or refused a request."""


def _parse_url(url: str) -> tuple[str, str, int]:
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise StoreError(f"bad store URL {url!r}: expected http://HOST:PORT")
    return parsed.scheme, parsed.hostname, parsed.port or 2379


class Store:
    """JSON key-value access to one job's keys in etcd."""

    def __init__(self, url: str, job_id: str, timeout: float = REQUEST_TIMEOUT_S):
        self.url = url
        self.job_id = job_id
        scheme, host, port = _parse_url(url)
        self.client = Etcd3Client(host=host, port=port, protocol=scheme, timeout=timeout)
        self.prefix = f"/transom/{job_id}/"

    # -- keys -------------------------------------------------------------------------------
    def key(self, name: str) -> str:
        return self.prefix + name

    # -- plain access -----------------------------------------------------------------------
    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError) as e:
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
