"""A launcher without a mirror (transom/run_mirror.py `JobFollower`), against a real etcd: on a
job of many machines only one launcher mirrors every key; the others get the job record pushed,
read etcd only every PROBE_S, and still count a silent etcd as an outage."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from conftest import etcd_requests, wait_for

from transom import run_mirror
from transom.common import keys
from transom.run_mirror import JobFollower
from transom.store import Store, StoreAccess, StoreError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from torture_proxy import StoreProxy  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def test_the_job_record_comes_pushed_and_etcd_is_probed_only_every_probe_period(etcd, store):
    proxy = StoreProxy(etcd.access.host, etcd.access.port, "launcher")
    access = StoreAccess(proxy.url, etcd.access.ca, etcd.access.cert, etcd.access.key)
    store.put(keys.JOB, {"state": "RUNNING", "n": 1})
    follower = JobFollower(Store(access, store.job_id))
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
        with pytest.raises(StoreError):
            follower.value(later + run_mirror.PROBE_S)
    finally:
        proxy.set_pass()
        follower.stop()
        proxy.close()
