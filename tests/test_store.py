"""Tests for transom/store against a real (embedded) etcd, and controller leader election on it.

The embedded etcd speaks only mutual TLS: a client without the run's client certificate gets
no data and changes nothing (shown with plain HTTP clients below).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import stat
import time
import urllib.error
import urllib.request

import pytest
from conftest import etcd_requests, running_etcd

from transom.common import keys
from transom.common.records import Plan
from transom.common.states import JobState
from transom.control.controller import Controller
from transom.job_spec import ConfigError, JobSpec
from transom.store import Store, StoreAccess, StoreError
from transom.store.etcd_client import LARGE_TXN_OPS, MAX_TXN_OPS
from transom.store.spec import read_spec

pytestmark = pytest.mark.timeout(60)


# -- plain access ---------------------------------------------------------------------------------


def test_get_missing_is_none(store):
    assert store.get("nothing") is None
    assert store.get_prefix("nothing/") == {}


def test_put_get_json_values(store):
    value = {"state": "RUNNING", "members": ["node0", "node1"], "n": 3, "x": 0.5, "none": None}
    store.put("job", value)
    assert store.get("job") == value
    store.put("job", "replaced")
    assert store.get("job") == "replaced"
    store.delete("job")
    assert store.get("job") is None


def test_get_prefix_strips_the_prefix_and_sorts(store):
    store.put("nodes/node2", {"n": 2})
    store.put("nodes/node0", {"n": 0})
    store.put("nodes/node1", {"n": 1})
    store.put("nodesX", "not under nodes/")
    store.put("status/node0", "other")
    got = store.get_prefix("nodes/")
    assert list(got) == ["node0", "node1", "node2"]
    assert got["node1"] == {"n": 1}


def test_jobs_are_isolated(etcd, store):
    store.put("spec", {"a": 1})
    other = Store(etcd.access, store.job_id + "-other")
    assert other.get("spec") is None
    store.delete_job()
    assert store.get("spec") is None


def test_write_all_takes_one_request_per_transaction_limit(store):
    names = [f"many/{i:04d}" for i in range(LARGE_TXN_OPS + 5)]
    before = etcd_requests(store)
    store.write_all({name: (i, None) for i, name in enumerate(names)})
    assert etcd_requests(store) - before == 2  # a full transaction and the rest
    assert store.get_prefix("many/")["0130"] == 130
    store.put("many_other", 1)
    before = etcd_requests(store)
    store.write_all(dict.fromkeys(names))
    assert etcd_requests(store) - before == 2
    assert store.get_prefix("many/") == {} and store.get("many_other") == 1


@pytest.mark.integration
def test_an_etcd_that_allows_fewer_writes_a_transaction_gets_them_in_smaller_ones(tmp_path):
    with running_etcd(tmp_path / "etcd", max_txn_ops=MAX_TXN_OPS) as server:
        store = Store(server.access, "small-txns")
        writes = {f"many/{i:04d}": (i, None) for i in range(2 * MAX_TXN_OPS + 5)}
        before = etcd_requests(store)
        store.write_all(writes)
        # The large transaction refused whole, then three of etcd's size; never again large.
        assert etcd_requests(store) - before == 1 + 3 and store.txn_ops == MAX_TXN_OPS
        assert store.get_prefix("many/") == {name[5:]: v for name, (v, _) in writes.items()}
        assert store.create("leader", "ctl-a")
        events = {f"events/{i:04d}": i for i in range(MAX_TXN_OPS + 3)}
        assert store.put_if_leader("ctl-a", {**events, "job": {"g": 1}}) is True
        assert len(store.get_prefix("events/")) == len(events) and store.get("job") == {"g": 1}


def test_create_only_once(store):
    assert store.create("leader", "a") is True
    assert store.create("leader", "b") is False
    assert store.get("leader") == "a"


def test_put_if_leader(store):
    assert store.put_if_leader("ctl-a", {"job": {"g": 1}}) is False  # nobody leads yet
    assert store.get("job") is None
    assert store.create("leader", "ctl-a")
    assert store.put_if_leader("ctl-a", {"job": {"g": 2}, "plan": {"members": ["n0"]}}) is True
    assert store.get("job") == {"g": 2}
    assert store.get("plan") == {"members": ["n0"]}
    assert store.put_if_leader("ctl-b", {"job": {"g": 3}, "plan": {"members": []}}) is False
    assert store.get("job") == {"g": 2}  # nothing of the failed transaction was written
    assert store.get("plan") == {"members": ["n0"]}


def test_put_if_leader_past_the_transaction_limit_writes_all_or_stops_fenced(store):
    events = {f"events/{i:04d}": i for i in range(2 * LARGE_TXN_OPS + 3)}
    assert store.create("leader", "ctl-a")
    assert store.put_if_leader("ctl-b", {**events, "job": {"g": 1}}) is False
    assert store.get_prefix("events/") == {} and store.get("job") is None
    assert store.put_if_leader("ctl-a", {**events, "job": {"g": 1}, "plan": {"g": 1}}) is True
    assert len(store.get_prefix("events/")) == len(events)
    assert store.get("job") == {"g": 1} and store.get("plan") == {"g": 1}


def test_key_under_a_lease_disappears_after_revoke(store):
    lease = store.lease(30)
    store.put("nodes/node0", {"host": "h"}, lease=lease)
    assert store.create("leader", "me", lease=lease)
    store.put("kept", 1)
    assert store.refresh(lease) is True
    store.revoke(lease)
    assert store.get("nodes/node0") is None
    assert store.get("leader") is None
    assert store.get("kept") == 1
    assert store.refresh(lease) is False  # an expired lease cannot be kept alive


def test_unreachable_store_raises():
    s = Store("http://127.0.0.1:1", "j", timeout=1.0)
    assert s.healthy() is False
    start = time.monotonic()
    with pytest.raises(StoreError, match="cannot reach etcd"):
        s.wait_healthy(0.5)
    assert time.monotonic() - start < 5
    with pytest.raises(StoreError, match="cannot reach etcd"):
        s.get("spec")


@pytest.mark.parametrize("url", ["ftp://host:1", "http://", "http://:2379"])
def test_bad_url(url):
    with pytest.raises(StoreError, match="bad store URL"):
        Store(url, "j")


# -- leader election -------------------------------------------------------------------------------


@pytest.fixture
def controllers(store):
    store.put("spec", JobSpec(script=__file__).to_dict())
    made: list[Controller] = []

    def make(candidate_id: str) -> Controller:
        c = Controller(Store(store.access, store.job_id), candidate_id)
        c.spec = JobSpec.from_dict(c.store.get("spec"))
        made.append(c)
        return c

    yield make
    for c in made:
        c.stopping.set()
        if c.leading.is_set() and c.lease is not None:
            try:
                c.store.revoke(c.lease)
            except StoreError:
                pass


def test_exactly_one_controller_leads_and_the_successor_resumes(store, controllers):
    a, b = controllers("ctl-a"), controllers("ctl-b")
    assert a.spec.script == __file__
    won = [a._try_lead(), b._try_lead()]
    assert won == [True, False]
    assert a.leading.is_set() and not b.leading.is_set()
    assert store.get("leader") == "ctl-a"
    assert b._try_lead() is False  # still held: the keep-alive refreshes it

    # The leader makes progress; it is in etcd, fenced on its leadership.
    a.job.generation = 4
    a.job.members = ["node0", "node1"]
    a.job.restarts_used = 3
    a.job.state = JobState.RUNNING
    a._commit([], Plan(4, ["node0", "node1"], JobState.RUNNING))
    written = store.get("job")
    assert written["generation"] == 4

    # The leader goes away.
    a.stopping.set()
    store.revoke(a.lease)
    assert store.get("leader") is None

    assert b._try_lead() is True
    assert b.leading.is_set()
    assert store.get("leader") == "ctl-b"
    for key in ("generation", "members", "restarts_used", "state", "since"):
        assert b.job.to_dict()[key] == written[key]

    # The deposed leader's writes are refused and it notices it lost the lead.
    a.job.generation = 99
    a._commit([])
    assert not a.leading.is_set()
    assert store.get("job")["generation"] == 4

    events = store.get_prefix("events/")
    leads = [e for e in events.values() if e["kind"] == "leader"]
    assert [e["controller"] for e in leads] == ["ctl-a", "ctl-b"]


def test_leadership_race_has_one_winner(store, controllers):
    import threading

    candidates = [controllers(f"ctl-{i}") for i in range(4)]
    results: dict[str, bool] = {}
    barrier = threading.Barrier(len(candidates))

    def race(c: Controller) -> None:
        barrier.wait()
        results[c.candidate_id] = c._try_lead()

    threads = [threading.Thread(target=race, args=(c,)) for c in candidates]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results.values()) == [False, False, False, True]
    winner = next(c for c in candidates if results[c.candidate_id])
    assert store.get("leader") == winner.candidate_id
    assert store.get("job")["generation"] == 0


def test_rollback_forgets_only_the_checkpoints_the_bad_generation_wrote(store):
    """After a NaN rollback the bad generation's checkpoints at or after the bad step are dropped,
    so later restarts restore the newest good checkpoint again (not one from before the NaN)."""
    from transom.checkpoint import catalog

    for step, generation in ((20, 1), (40, 1), (60, 1), (60, 2), (80, 2)):
        for rank in (0, 1):
            holder, tier = ("storage", "storage") if generation == 1 else ("mem-node1", "memory")
            store.put(
                catalog.shard_key(step, rank, holder),
                {
                    "step": step,
                    "rank": rank,
                    "tier": tier,
                    "world_size": 2,
                    "generation": generation,
                },
            )
    dropped = catalog.discard_poisoned(store, first_bad_step=50, generation=2)
    assert dropped == [60]
    assert catalog.restorable_steps(store, world_size=2) == [80, 60, 40, 20]
    assert set(catalog.holders(store, 60, 0)) == {"mem-node1"}  # saved after the rollback: kept
    # Listed late (after the sweep) by generation 1: a server's own sweep of the steps it removed.
    late = {"tier": "storage", "world_size": 2, "generation": 1}
    for step in (60, 80):
        store.put(catalog.shard_key(step, 0, "storage"), {"step": step, "rank": 0, **late})
    store.put(catalog.SHARDS + "junk/0/storage", late)  # a key that does not parse: left alone
    assert catalog.forget(store, catalog.discards(store), [60]) == [60]
    assert set(catalog.holders(store, 60, 0)) == {"mem-node1"}
    assert set(catalog.holders(store, 80, 0)) == {"mem-node1", "storage"}  # not a step asked for


def test_a_listing_that_lands_after_a_discard_never_makes_its_step_restorable(store):
    """Servers list shards in the background: a listing of a discarded step can land after
    every sweep of the discard. It counts for nothing."""
    from transom.checkpoint import catalog

    def listed(step, generation):
        for rank in (0, 1):
            store.put(
                catalog.shard_key(step, rank, "storage"),
                {
                    "step": step,
                    "rank": rank,
                    "tier": "storage",
                    "world_size": 2,
                    "generation": generation,
                },
            )

    listed(20, 1)
    catalog.discard_poisoned(store, first_bad_step=30, generation=2)
    listed(40, 1)  # late: generation 1 went bad at step 30
    listed(60, 2)  # the next generation's
    assert sorted(catalog.shards(store)) == [20, 40, 60]
    assert catalog.restorable_steps(store, world_size=2) == [60, 20]
    # A value that is not a valid listing, or names another shard than its key, is not one.
    for bad in ({"step": 80, "rank": 0}, {"step": 81, "rank": 0, "tier": "storage"}, [1]):
        store.put(catalog.shard_key(80, 0, "storage"), bad)
        store.put(catalog.shard_key(80, 1, "storage"), {**bad, "rank": 1} if "step" in bad else bad)
        assert catalog.restorable_steps(store, world_size=2) == [60, 20]
        assert catalog.holders(store, 80, 0) == {}


# -- mutual TLS: nothing without the run's client certificate --------------------------------------


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _post(url: str, path: str, body: dict, context: ssl.SSLContext | None) -> bytes:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=5, context=context) as response:
        return response.read()


def test_anonymous_clients_get_no_data_and_change_nothing(etcd, store):
    store.put(keys.CKPT_SECRET, "the-secret")
    store.put(keys.LEADER, "ctl-real")
    prefix = store.prefix
    range_all = {"key": _b64(prefix), "range_end": _b64(prefix[:-1] + chr(ord(prefix[-1]) + 1))}
    forged_leader = {"key": _b64(store.key(keys.LEADER)), "value": _b64('"ctl-forged"')}
    trusting = ssl.create_default_context(cafile=str(etcd.access.ca))  # trusts etcd, no client cert
    blind = ssl._create_unverified_context()  # trusts anything, no client cert
    for context in (trusting, blind):
        for path, body in (("/v3/kv/range", range_all), ("/v3/kv/put", forged_leader)):
            with pytest.raises(OSError):  # the handshake (or the first read) fails
                _post(etcd.url, path, body, context)

    secret_bytes = (b"the-secret", _b64('"the-secret"').encode())
    # The same request with the client certificate gets the data: the refusals are the TLS's.
    holder = ssl.create_default_context(cafile=str(etcd.access.ca))
    holder.load_cert_chain(str(etcd.access.cert), str(etcd.access.key))
    assert secret_bytes[1] in _post(etcd.url, "/v3/kv/range", range_all, holder)

    plain = etcd.url.replace("https://", "http://")
    for path, body in (("/v3/kv/range", range_all), ("/v3/kv/put", forged_leader)):
        with pytest.raises(OSError) as refused:  # closed, or answered with an error status
            _post(plain, path, body, None)
        if isinstance(refused.value, urllib.error.HTTPError):
            answer = refused.value.read()
            assert not any(secret in answer for secret in secret_bytes)

    # A raw request on the socket: no answer, or one that holds nothing of the job.
    with socket.create_connection((etcd.access.host, etcd.access.port), timeout=5) as raw:
        data = json.dumps(range_all).encode()
        raw.sendall(
            b"POST /v3/kv/range HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        try:
            answer = raw.recv(65536)
        except OSError:
            answer = b""
    assert not answer.startswith(b"HTTP/1.1 200")
    assert not any(secret in answer for secret in secret_bytes)

    assert store.get(keys.CKPT_SECRET) == "the-secret"  # with the certificate: works, unchanged
    assert store.get(keys.LEADER) == "ctl-real"


def test_a_client_without_the_certificate_is_refused_by_the_store(etcd):
    no_cert = Store(StoreAccess(etcd.url, ca=etcd.access.ca), "j", timeout=2.0)
    assert no_cert.healthy() is False
    with pytest.raises(StoreError, match="TLS handshake failed"):
        no_cert.get("spec")
    wrong_ca = Store(StoreAccess(etcd.url, ca=etcd.access.cert), "j", timeout=2.0)
    with pytest.raises(StoreError, match="TLS handshake failed"):
        wrong_ca.get("spec")


def test_certificates_are_private_and_the_ca_key_is_not_kept(etcd):
    directory = etcd.tls_dir
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["ca.crt", "client.crt", "client.key", "server.crt", "server.key"]
    for path in directory.iterdir():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    assert stat.S_IMODE(os.stat(etcd.data_dir).st_mode) == 0o700  # etcd's files hold every key
    access = etcd.access
    assert access.url.startswith("https://127.0.0.1:")
    assert {access.ca, access.cert, access.key} <= set(directory.iterdir())


# -- the spec, read back validated -----------------------------------------------------------------


def test_a_bad_spec_is_refused_with_one_line_and_an_event(store):
    store.put(keys.SPEC, {**JobSpec(script=__file__, job_id=store.job_id).to_dict(), "spares": "2"})
    with pytest.raises(ConfigError, match="refused.*spares") as refused:
        read_spec(store, 1.0, check_script=False, reader="node0")
    assert "\n" not in str(refused.value)
    events = list(store.get_prefix(keys.EVENTS).values())
    assert [e["kind"] for e in events] == ["warning"] and "spares" in events[0]["message"]

    store.put(keys.SPEC, JobSpec(script=__file__, job_id=store.job_id).to_dict())
    assert read_spec(store, 1.0, check_script=True, reader="node0").script == __file__


def test_agent_and_controller_refuse_a_bad_spec_without_a_traceback(etcd, store, tmp_path):
    """A spec whose script does not exist here: the agent (which would run it) and the
    controller (which checks everything but the file) exit 2 with one line, run nothing."""
    import subprocess
    import sys

    common = [*etcd.access.argv(), "--job-id", store.job_id]
    bad = {"script": "/nonexistent/train.py", "job_id": store.job_id, "nproc_per_node": "8"}
    store.put(keys.SPEC, bad)
    for argv in (
        ["agent", *common, "--node-id", "node0", "--run-dir", str(tmp_path)],
        ["controller", *common, "--candidate-id", "ctl-0"],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "transom", *argv], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr and "refused" in out.stderr.splitlines()[-1]
        assert "nproc_per_node" in out.stderr
    assert store.get(keys.LEADER) is None and store.get_prefix(keys.NODES) == {}
    warnings = [e for e in store.get_prefix(keys.EVENTS).values() if e["kind"] == "warning"]
    assert {e["writer"] for e in warnings} == {"node0", "ctl-0"}
