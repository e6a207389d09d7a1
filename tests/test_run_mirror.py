"""How a launcher follows its job (transom/run_mirror.py), against a real etcd: on a job of many
machines only one launcher mirrors every key (`RunMirror`); the others get the job record pushed
(`JobFollower`), read etcd only every PROBE_S, and still count a silent etcd as an outage. The
mirror takes the job record the same way, and rewrites its files only when something changed."""

from __future__ import annotations

import json
import time

import pytest
from conftest import etcd_requests, wait_for
from rich.console import Console

from transom import run_mirror
from transom.common import files, keys
from transom.run_mirror import JobFollower, RunMirror
from transom.store import Store, StoreAccess, StoreError
from transom.testing.store_proxy import StoreProxy

pytestmark = pytest.mark.timeout(90)


def test_the_job_record_comes_pushed_and_etcd_is_probed_only_every_probe_period(etcd, store):
    proxy = StoreProxy(etcd.access.host, etcd.access.port, "launcher")
    access = StoreAccess(proxy.url, etcd.access.ca, etcd.access.cert, etcd.access.key)
    store.put(keys.JOB, {"state": "RUNNING", "n": 1})
    follower = JobFollower(Store(access, store.job_id, deadline_s=1.0))
    try:
        now = time.monotonic()  # the launcher's clock, stepped here as its polls would
        assert follower.value(now) == {"state": "RUNNING", "n": 1}
        wait_for(lambda: follower.job.watch.healthy, 10, "the watch stream to be up")
        before = etcd_requests(store)
        polls = int(run_mirror.PROBE_S / 0.5) - 1  # a launcher's polls before the next probe
        for i in range(1, polls + 1):
            follower.value(now + 0.5 * i)
        assert follower.job.reads == 1 and etcd_requests(store) - before < 2  # nothing read
        follower.value(now + run_mirror.PROBE_S)
        assert follower.job.reads == 2  # the probe: etcd's answer is the outage count's evidence

        store.put(keys.JOB, {"state": "SUCCEEDED", "n": 2})
        later = now + run_mirror.PROBE_S + 0.5  # before the next probe: this one comes pushed
        wait_for(lambda: follower.value(later)["n"] == 2, 10, "the job record to be pushed")
        assert follower.job.reads == 2

        proxy.set_blackhole()  # etcd silent: its watch says nothing, the next probe fails
        asked = time.monotonic()
        with pytest.raises(StoreError):
            follower.value(later + run_mirror.PROBE_S)
        # ... within the launcher's store deadline (1 s here), not the default one (4 s)
        assert time.monotonic() - asked < 3.0
    finally:
        proxy.set_pass()
        follower.stop()
        proxy.close()


def test_the_mirror_rewrites_its_files_only_when_something_changed(etcd, store, tmp_path):
    store.put(keys.JOB, {"state": "RUNNING", "generation": 1})
    mirror = RunMirror(store, tmp_path, Console(quiet=True), total_steps=None)
    status = tmp_path / files.STATUS
    try:
        now = time.monotonic()

        def shown(at: float) -> dict:
            mirror.show(at, mirror.value(at), False, None)
            return json.loads(status.read_text())

        first = shown(now)
        assert first["job"]["state"] == "RUNNING"
        wait_for(lambda: mirror.watch.watch.healthy, 10, "the mirror's watch to be up")
        wait_for(lambda: mirror.job.job.watch.healthy, 10, "the job record's watch to be up")
        assert shown(now + 0.5)["time"] == first["time"]  # nothing changed: not rewritten
        reads = mirror.job.job.reads

        store.put(keys.status("node0"), {"node": "node0", "state": "RUNNING"})
        wait_for(lambda: shown(now + 1.0)["time"] != first["time"], 10, "a rewrite on change")
        store.put(keys.JOB, {"state": "SUCCEEDED", "generation": 1})
        wait_for(lambda: mirror.value(now + 1.5)["state"] == "SUCCEEDED", 10, "a pushed job")
        assert mirror.job.job.reads == reads  # the job record came pushed, not read
        changed = shown(now + 1.5)
        assert changed["job"]["state"] == "SUCCEEDED"
        assert shown(now + 1.5 + run_mirror.PROBE_S)["time"] != changed["time"]  # kept recent
    finally:
        mirror.stop()


def test_the_mirror_writes_each_event_once_and_keeps_none_in_its_copy(etcd, store, tmp_path):
    store.put(keys.JOB, {"state": "RUNNING", "generation": 1})
    mirror = RunMirror(store, tmp_path, Console(quiet=True), total_steps=None)
    written = tmp_path / files.EVENTS

    def lines() -> list[dict]:
        return [json.loads(x) for x in written.read_text().splitlines()] if written.exists() else []

    try:
        now = time.monotonic()
        mirror.show(now, mirror.value(now), False, None)
        wait_for(lambda: mirror.watch.watch.healthy, 10, "the mirror's watch to be up")
        for i in range(20):
            event = {"time": 1000.0 + i, "kind": "checkpoint", "message": f"saved {i}"}
            store.put(keys.event(1000.0 + i, "node0"), event)

        def mirrored() -> bool:
            mirror.show(now, mirror.value(now), False, None)
            return len(lines()) == 20

        wait_for(mirrored, 10, "the 20 events in events.jsonl")
        assert not [n for n in mirror.watch.values if n.startswith(keys.EVENTS)]
        mirror.watch.read(now)  # a direct read (the watch was down) brings them all back ...
        assert len([n for n in mirror.watch.values if n.startswith(keys.EVENTS)]) == 20
        later = now + run_mirror.PROBE_S  # a rewrite is due, changed or not
        mirror.show(later, mirror.value(later), False, None)
        assert len(lines()) == 20  # ... and none is written twice
        assert not [n for n in mirror.watch.values if n.startswith(keys.EVENTS)]
    finally:
        mirror.stop()


def test_the_mirror_reads_the_job_record_only_when_its_watch_heard_nothing_for_a_probe_period(
    etcd, store, tmp_path
):
    """A running job's summaries reach the mirror's watch several times a second: each is etcd
    answering, so the direct read of the job record (the launcher's outage evidence) is made
    only once the watch has been silent for PROBE_S."""
    store.put(keys.JOB, {"state": "RUNNING", "generation": 1})
    mirror = RunMirror(store, tmp_path, Console(quiet=True), total_steps=None)
    try:
        now = time.monotonic()
        mirror.show(now, mirror.value(now), False, None)
        wait_for(lambda: mirror.watch.watch.healthy, 10, "the mirror's watch to be up")
        reads = mirror.job.job.reads
        for i in range(1, int(3 * run_mirror.PROBE_S / 0.5)):  # polls over 3 probe periods
            at = now + 0.5 * i
            store.put(keys.monitor("node0"), {"node": "node0", "step": i})
            heard = mirror.watch.heard_at
            wait_for(lambda at=at, heard=heard: _took(mirror, at, heard), 10, "the put pushed")
            mirror.show(at, mirror.value(at), False, None)
        assert mirror.job.job.reads == reads  # etcd was heard every poll: nothing read
        silent = mirror.watch.heard_at + run_mirror.PROBE_S
        mirror.show(silent, mirror.value(silent), False, None)
        assert mirror.job.job.reads == reads + 1  # a probe period without a word: read
    finally:
        mirror.stop()


def _took(mirror: RunMirror, at: float, heard_before: float) -> bool:
    """Whether the mirror's watch delivered something new by `at` (taking it in)."""
    mirror.watch.refresh(at)
    return mirror.watch.heard_at > heard_before
