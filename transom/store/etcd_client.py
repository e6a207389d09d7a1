"""`Store`: the job's view of etcd, with JSON values under one key prefix per job.

Every key of a job lives under /transom/<job-id>/; the key names and what each holds are
defined once in transom.common.keys, the values' shapes in transom.common.records.

How it reaches etcd (URL, TLS files) is a `StoreAccess` (access.py).

Writes that only the leader may make go through `put_if_leader`, a transaction that compares
the leader key, so a deposed controller cannot overwrite its successor's decisions.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import Etcd3Client
from etcd3gw.lease import Lease as GatewayLease
from etcd3gw.utils import _encode

from transom.common import keys
from transom.store.access import FLAG_CA, FLAG_CERT, FLAG_KEY, StoreAccess, StoreError
from transom.store.gateway import GatewayClient
from transom.store.retry import (
    DEFAULT_DEADLINE_S,
    MIN_ATTEMPT_S,
    RetryPolicy,
    retry,
    tls_refusal,
)

REQUEST_TIMEOUT_S = 5.0
# Renewals of a lease per TTL (every holder: a node's agent, a checkpoint server, the leading
# controller): one may fail or stall before the lease can expire. Two, not four (issue 44: a
# renewal is an etcd request every holder makes for ever, and the job's whole budget is one a
# node a second): the node agent's fence (transom.control.fence) pauses its workers at 3/4 of
# the TTL without an answered renewal, which leaves a renewal a quarter of the TTL to be
# answered (2 s at the default --node-ttl 8) before a pause that etcd answering late would cost.
REFRESHES_PER_TTL = 2
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops: the most writes one transaction may hold
# What an etcd Transom starts allows (embedded.py passes --max-txn-ops), and what a Store tries
# first: a checkpoint server saving every step queues several hundred writes (its listings, its
# withdrawals, its events) in the batch writer's few seconds, which at 128 a transaction were a
# request a second per node (issue 44). An etcd that allows fewer refuses the transaction whole
# (TOO_MANY_OPS); the Store then writes in transactions of MAX_TXN_OPS from there on.
LARGE_TXN_OPS = 1024
TOO_MANY_OPS = "too many operations in txn request"

T = TypeVar("T")


def _text(path: object) -> str | None:
    return None if path is None else str(path)


class Lease(GatewayLease):
    """An etcd lease that knows its time-to-live and when (on this process's monotonic clock)
    it was last granted or renewed: from then on etcd keeps it for `ttl_s` at least."""

    def __init__(self, id: int, client: Etcd3Client, ttl_s: float, renewed_at: float):
        super().__init__(id, client)
        self.ttl_s = ttl_s
        self.renewed_at = renewed_at

    def expires_in(self) -> float:
        """Seconds until etcd may expire it, unless renewed before."""
        return self.renewed_at + self.ttl_s - time.monotonic()


class Store:
    """JSON key-value access to one job's keys in etcd.

    `access` is a `StoreAccess` (URL and TLS files) or, for plain http, just the URL. Every
    request goes through one `RetryPolicy` (retry.py): transient failures are retried for up to
    `deadline_s` seconds, each attempt limited to `timeout` seconds; then StoreError.
    """

    def __init__(
        self,
        access: StoreAccess | str,
        job_id: str,
        timeout: float = REQUEST_TIMEOUT_S,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ):
        self.access = access if isinstance(access, StoreAccess) else StoreAccess(access)
        self.url = self.access.url
        self.job_id = job_id
        self.policy = RetryPolicy(deadline_s=deadline_s, request_timeout_s=timeout)
        self.txn_ops = LARGE_TXN_OPS  # the most writes a transaction holds (see `_transact`)
        self.client = GatewayClient(
            host=self.access.host,
            port=self.access.port,
            protocol=self.access.scheme,
            ca_cert=_text(self.access.ca),
            cert_cert=_text(self.access.cert),
            cert_key=_text(self.access.key),
            timeout=timeout,
            api_path="/v3/",  # etcd >= 3.4; no discovery request before the first real one
        )
        self.prefix = f"/transom/{job_id}/"

    def with_deadline(self, deadline_s: float) -> Store:
        """This store (same connection pool) with another retry deadline."""
        other = copy.copy(self)
        other.policy = RetryPolicy(
            deadline_s=deadline_s, request_timeout_s=self.policy.request_timeout_s
        )
        return other

    # -- keys -------------------------------------------------------------------------------
    def key(self, name: str) -> str:
        return self.prefix + name

    # -- plain access -----------------------------------------------------------------------
    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` (a request of the client) under the retry policy."""
        return self._retried(lambda: fn(*args, **kwargs))

    def _retried(self, request: Callable[[], T], deadline_s: float | None = None) -> T:
        policy = self.policy
        if deadline_s is not None:
            policy = RetryPolicy(deadline_s=deadline_s, request_timeout_s=policy.request_timeout_s)
        try:
            return retry(
                lambda timeout_s: self.client.attempt(timeout_s, request),
                policy,
                f"cannot reach etcd at {self.url}",
            )
        except StoreError:
            raise
        except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError) as e:
            reason = tls_refusal(e)
            if reason is not None:  # a certificate was refused: ours by etcd, or etcd's by us
                raise StoreError(
                    f"cannot reach etcd at {self.url}: the TLS handshake failed ({reason}; "
                    f"check {FLAG_CA}, {FLAG_CERT} and {FLAG_KEY})"
                ) from e
            raise StoreError(f"cannot reach etcd at {self.url}: {type(e).__name__}") from e
        except etcd_errors.Etcd3Exception as e:
            raise StoreError(f"etcd at {self.url} refused a request: {_detail(e)}") from e

    def request(
        self, path: str, body: dict[str, Any], deadline_s: float | None = None
    ) -> dict[str, Any]:
        """One request to etcd's HTTP gateway (`path` under /v3/, e.g. "maintenance/status")."""
        url = self.client.get_url(path)
        return self._retried(lambda: self.client.post(url, json=body), deadline_s)

    def healthy(self) -> bool:
        try:
            self.client.status()
            return True
        except Exception:  # noqa: BLE001 - any failure means "not usable now"
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Return once etcd answers; StoreError (with the reason) if it does not in `timeout_s`."""
        self._retried(self.client.status, deadline_s=timeout_s)

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
        """Write `name` only if it does not exist; True when this call created it.

        A transaction that puts only if the key was never created. When an attempt was lost
        (its answer never came) and a later one finds the key, the key is ours if it holds
        exactly our value (and lease): the lost attempt wrote it.
        """
        key, data = _encode(self.key(name)), _encode(json.dumps(value))
        put: dict[str, Any] = {"key": key, "value": data}
        if lease is not None:
            put["lease"] = lease.id
        txn = {
            "compare": [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": key}}],
        }
        attempts = 0

        def attempt() -> bool:
            nonlocal attempts
            attempts += 1
            answer = self.client.transaction(txn)
            if answer.get("succeeded", False):
                return True
            if attempts == 1:
                return False
            return _holds(answer, data, None if lease is None else lease.id)

        return self._retried(attempt)

    def write_all(self, writes: dict[str, tuple[Any, Lease | None] | None]) -> None:
        """Puts (name -> (value, lease or None)) and deletes (name -> None) in as few requests
        as etcd allows (one transaction per `txn_ops`: many small writes cost etcd one request
        each otherwise); each name once, in no particular order."""
        self._transact(_ops(self, writes))

    def _transact(
        self, ops: list[dict[str, Any]], compare: tuple[dict[str, Any], ...] = ()
    ) -> bool:
        """`ops` in transactions of at most `txn_ops` (LARGE_TXN_OPS, or MAX_TXN_OPS once etcd
        refused more; the last one full: what must land together goes last), each under
        `compare`; False at the first one refused."""
        size = self.txn_ops
        ends = range(len(ops), 0, -size)
        chunks = list(reversed([ops[max(0, end - size) : end] for end in ends]))
        for i, chunk in enumerate(chunks):
            txn = {"compare": list(compare), "success": chunk, "failure": []}
            try:
                answer = self._call(self.client.transaction, txn)
            except StoreError as e:
                if TOO_MANY_OPS not in str(e) or size <= MAX_TXN_OPS:
                    raise
                self.txn_ops = MAX_TXN_OPS  # refused whole: nothing of it landed
                return self._transact([op for c in chunks[i:] for op in c], compare)
            if not answer.get("succeeded", False):
                return False
        return True

    def delete(self, name: str) -> None:
        self._call(self.client.delete, self.key(name))

    def delete_range(self, start: str, end: str) -> None:
        """Delete every name from `start` up to, not including, `end` (one request)."""
        self._call(self.client.delete, self.key(start), range_end=self.key(end))

    def delete_prefix(self, name: str) -> None:
        self._call(self.client.delete_prefix, self.key(name))

    def delete_job(self) -> None:
        self._call(self.client.delete_prefix, self.prefix)

    def lease(self, ttl_s: int) -> Lease:
        """A new lease (a grant whose answer was lost leaves an unused lease that expires)."""
        asked_at = time.monotonic()
        granted = self._call(self.client.lease, ttl_s)
        return Lease(granted.id, self.client, ttl_s, asked_at)

    def lease_of(self, lease_id: int) -> Lease:
        """Another process's lease, by id, to put keys under; this process must never renew or
        revoke it (its holder does)."""
        return Lease(lease_id, self.client, 0, -math.inf)

    def refresh(self, lease: Lease, deadline_s: float | None = None) -> bool:
        """Keep a lease alive; False when it has already expired.

        It keeps trying (transient failures) until `deadline_s`, by default until the lease
        may expire (a refresh after that is no use to its caller), but at least MIN_ATTEMPT_S
        and at most the store's deadline; then StoreError.
        """
        if deadline_s is None:
            deadline_s = min(self.policy.deadline_s, max(MIN_ATTEMPT_S, lease.expires_in()))
        asked_at = time.monotonic()
        alive = self._retried(lease.refresh, deadline_s) > 0
        if alive:
            lease.renewed_at = asked_at  # etcd renewed it at or after this moment
        return alive

    def revoke(self, lease: Lease) -> None:
        """End a lease and delete its keys; a lease already gone (expired, or revoked by an
        attempt whose answer was lost) is no error."""

        def attempt() -> None:
            try:
                lease.revoke()
            except etcd_errors.Etcd3Exception as e:
                if "lease not found" not in (e.detail_text or ""):
                    raise

        self._retried(attempt)

    # -- fenced writes ----------------------------------------------------------------------
    def put_if_leader(self, leader_id: str, values: dict[str, Any]) -> bool:
        """Write all `values` only while `leader` still holds `leader_id`: in one transaction,
        or, past what etcd allows (`txn_ops`: a decision about a thousand nodes has an event for
        each), in fenced transactions of at most that many, in the order given, stopping at the
        first refused (so a caller puts what must land together last: the job record and the
        plan)."""
        fence = {
            "key": _encode(self.key(keys.LEADER)),
            "result": "EQUAL",
            "target": "VALUE",
            "value": _encode(json.dumps(leader_id)),
        }
        return self._transact(_ops(self, {n: (v, None) for n, v in values.items()}), (fence,))


def _ops(store: Store, writes: dict[str, tuple[Any, Lease | None] | None]) -> list[dict[str, Any]]:
    """The transaction operations of `writes` under `store`'s job, in order: name -> (value,
    lease or None) puts the value as JSON, name -> None deletes the key."""
    ops: list[dict[str, Any]] = []
    for name, write in writes.items():
        key = _encode(store.key(name))
        if write is None:
            ops.append({"request_delete_range": {"key": key}})
            continue
        value, lease = write
        put: dict[str, Any] = {"key": key, "value": _encode(json.dumps(value))}
        if lease is not None:
            put["lease"] = lease.id
        ops.append({"request_put": put})
    return ops


def _detail(error: etcd_errors.Etcd3Exception) -> str:
    """The message of an etcd error (its gateway's JSON body), short."""
    text = error.detail_text or ""
    try:
        body = json.loads(text)
        return str(body.get("error") or body.get("message") or text)[:300]
    except (TypeError, ValueError, AttributeError):
        return (text or str(error) or type(error).__name__)[:300]


def _holds(answer: Any, value: str, lease_id: int | None) -> bool:
    """Whether the range in a transaction's failure answer holds `value` (base64) and lease."""
    try:
        kvs = answer["responses"][0]["response_range"].get("kvs", [])
        kv = kvs[0]
        same_lease = lease_id is None or int(kv.get("lease", 0)) == lease_id
        return bool(kv.get("value") == value and same_lease)
    except (KeyError, IndexError, TypeError, ValueError):
        return False
