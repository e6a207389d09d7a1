"""The controller's I/O loop: leadership, a snapshot of etcd each tick, `decide`, a fenced commit.

Several candidates may run; one wins leadership by creating the `leader` key under its lease,
and every write it makes is fenced on still holding that key. All decisions and the state
they need (generation, members, evictions, failure history, restart budget) live in the
`job` record, so a candidate that takes over after the leader died continues where it
stopped. The rules themselves are in transom.control.decisions (pure, unit-tested); each
decision is also an event with a reason in `events/`.

The controller never touches processes: it writes the `plan` and the agents act on it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from transom.checkpoint.catalog import discard_poisoned, newest_restorable
from transom.common import keys
from transom.common.records import (
    Event,
    EventKind,
    JobRecord,
    MonitorSummary,
    NodeRegistration,
    NodeStatus,
    Plan,
    PreflightResult,
    RecordError,
    parse_all,
)
from transom.common.states import JobState
from transom.config import JobSpec
from transom.control.decisions import Memory, Snapshot, decide
from transom.control.observed import Observed
from transom.monitor.exporter import MonitorExporter
from transom.store import Store, StoreError
from transom.store.client import Lease
from transom.store.spec import read_spec
from transom.utils.net import bind_address, host_address

log = logging.getLogger("transom.controller")

TICK_S = 0.2
LEADER_TTL_S = 3
SPEC_WAIT_S = 120.0


class Controller:
    """One controller candidate for one job.

    `candidate_id` must be unique to this process (never reused by a restarted candidate): the
    leader's writes are fenced by comparing it with the value of the `leader` key.
    """

    def __init__(self, store: Store, candidate_id: str):
        self.store = store
        self.candidate_id = candidate_id
        self.spec: JobSpec | None = None
        self.job: JobRecord | None = None
        self.lease: Lease | None = None
        self.leading = threading.Event()
        self.stopping = threading.Event()
        self.exporter = MonitorExporter()
        self.memory = Memory()  # the detectors' in-memory state (see decisions.Memory)
        self.observed = Observed()  # summary ages and store gaps, on this process's clock
        self.terminated = False  # SIGTERM: hand leadership over and exit 0

    # -- leadership ---------------------------------------------------------------------------
    def _try_lead(self) -> bool:
        assert self.spec is not None
        lease = self.store.lease(LEADER_TTL_S)
        if not self.store.create(keys.LEADER, self.candidate_id, lease=lease):
            self.store.revoke(lease)
            return False
        self.lease = lease
        self.leading.set()
        threading.Thread(target=self._keep_leading, name="leader-keepalive", daemon=True).start()
        stored = self.store.get(keys.JOB)
        self.job = JobRecord.from_dict(stored) if stored else JobRecord.new(time.time())
        if self.exporter.port is None and self.spec.metrics_port >= 0:
            host = bind_address(self.store.url, host_address())
            port = self.exporter.serve(self.spec.metrics_port, host)
            if port is not None:
                url = f"http://{host}:{port}/metrics"
                self.store.put(keys.EXPORTER, {"url": url, "controller": self.candidate_id})
        message = (
            f"controller {self.candidate_id} leads the job "
            f"(state {self.job.state.value}, generation {self.job.generation})"
        )
        since_gap = self.observed.since_gap(time.monotonic())
        if since_gap is not None and since_gap < self.spec.node_ttl_s:
            message += f", after etcd did not answer it for {self.observed.gap_s:.1f} s"
        self._commit([Event(time.time(), EventKind.LEADER, message, self.job.generation)])
        return True

    def _keep_leading(self) -> None:
        lease = self.lease
        assert lease is not None
        while self.leading.is_set() and not self.stopping.wait(LEADER_TTL_S / 4):
            try:
                if not self.store.refresh(lease):
                    log.warning("leadership lease expired")
                    self.leading.clear()
            except StoreError:
                pass

    def _commit(self, events: list[Event], plan: Plan | None = None) -> None:
        """Write the job record, the plan and new events in one transaction fenced on leadership."""
        assert self.job is not None
        self.job.updated = time.time()
        values = {keys.JOB: self.job.to_dict()}
        if plan is not None:
            values[keys.PLAN] = plan.to_dict()
        for e in events:
            e.controller = self.candidate_id
            values[keys.event(e.time, self.candidate_id)] = e.to_dict()
            log.info("%s: %s", e.kind.value, e.message)
        if not self.store.put_if_leader(self.candidate_id, values):
            log.warning("lost leadership; not writing")
            self.leading.clear()

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> int:
        """Lead or stand by until the job ends; 0 if it succeeded (or SIGTERM asked to stop).

        No etcd error ends it: a failed or stalled store call is a gap (`observed`), retried."""
        previous = self._catch_sigterm()
        code = 1
        try:
            code = self._serve()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self.stopping.set()
            self.exporter.stop()
            if self.leading.is_set() and self.lease is not None:
                self.leading.clear()
                try:
                    self.store.revoke(self.lease)  # a standby takes over at once
                except StoreError:
                    pass
            log.info("controller %s exits with code %d", self.candidate_id, code)
        return code

    def _serve(self) -> int:
        while self.spec is None and not self.stopping.is_set():
            try:
                self.spec = read_spec(
                    self.store, SPEC_WAIT_S, check_script=False, reader=self.candidate_id
                )
            except StoreError as e:
                log.warning("cannot read the job spec yet: %s", e)
                self.stopping.wait(1.0)
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                if not self.leading.is_set():
                    stored = self.store.get(keys.JOB)
                    self.observed.reached(time.monotonic(), started)
                    job = JobRecord.from_dict(stored) if stored else None
                    if job and job.state.terminal:
                        return 0 if job.state is JobState.SUCCEEDED else 1
                    if not self._try_lead():
                        self.stopping.wait(TICK_S)
                        continue
                self._step(started)
                assert self.job is not None
                if self.job.state.terminal and self.leading.is_set():
                    return 0 if self.job.state is JobState.SUCCEEDED else 1
            except (StoreError, RecordError) as e:
                log.warning("store error: %s", e)
                self.stopping.wait(1.0)
            self.stopping.wait(TICK_S)
        return 0 if self.terminated else 1

    def _catch_sigterm(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def leave(signum, frame):
            log.warning("SIGTERM: handing leadership over and exiting")
            self.terminated = True
            self.stopping.set()

        return signal.signal(signal.SIGTERM, leave)

    def snapshot(self, started: float | None = None) -> Snapshot:
        """What `decide` needs, read from etcd (values that are not valid records are ignored)."""
        assert self.job is not None and self.spec is not None
        job, get = self.job, self.store.get_prefix
        summaries = parse_all(MonitorSummary, get(keys.MONITOR))
        # A node is alive while its registration key exists (its lease holds), whatever it holds.
        registered = get(keys.NODES)
        valid = parse_all(NodeRegistration, registered)
        snap = Snapshot(
            nodes={n: valid.get(n) for n in registered},
            statuses=parse_all(NodeStatus, get(keys.STATUS)),
            summaries={n: s for n, s in summaries.items() if n in job.members},
            preflight=parse_all(PreflightResult, get(keys.PREFLIGHT)),
        )
        now = time.monotonic()
        self.observed.reached(now, now if started is None else started)
        snap.summary_ages = self.observed.summary_ages(snap.summaries, now)
        snap.store_gap_s, snap.since_store_gap_s = self.observed.gap_s, self.observed.since_gap(now)
        nxt = job.next_generation
        if nxt is not None and not job.state.terminal:
            snap.restore_step = newest_restorable(
                self.store,
                len(nxt.members) * self.spec.nproc_per_node,
                before=job.rollback_before,
                lost=[*nxt.lost, *job.evicted],
            )
        return snap

    def _step(self, started: float | None = None) -> None:
        assert self.job is not None and self.spec is not None
        snap = self.snapshot(started)
        self.exporter.update(self.job, snap.summaries)
        d = decide(self.job, snap, self.spec, time.time(), self.memory)
        self.memory = d.memory
        for anomaly in d.anomalies:
            self.exporter.count(anomaly)
        if d.discard_poisoned is not None:
            discard_poisoned(self.store, *d.discard_poisoned)
        if d.changed:
            self.job = d.job
            self._commit(d.events, d.plan)
