"""The controller's I/O loop: leadership, a watched view of etcd, `decide`, a fenced commit.

Several candidates may run; one wins leadership by creating the `leader` key under its lease,
and every write it makes is fenced on still holding that key. All decisions and the state
they need (generation, members, evictions, failure history, restart budget) live in the
`job` record, so a candidate that takes over after the leader died continues where it
stopped. The rules themselves are in transom.control.decisions (pure, unit-tested); each
decision is also an event with a reason in `events/`.

Nothing is polled. The leader follows what the agents publish through etcd watches
(transom.control.cluster_view) and ticks when something changed, a tick's commit asks for the
next one (a generation's plan right after the tick that decided it; an incident's diagnosis
when its settle time is up), or a timer runs out (TICK_S while the job is changing,
STEADY_TICK_S while it runs, or STEPS_PER_TICK median steps if shorter, for the straggler
detector: the time-based rules, hang and telemetry-gap ages, warm-up timeouts). A node's
death is the delete of its lease-bound registration, pushed like any other change. A standby
waits on the leader key's delete (transom.control.leader_watch) and only then tries to lead.
Each candidate's one steady store call, the leader's lease refresh or a standby's read of the
leader key (transom.control.contact), measures its gaps to etcd: the leader never acts on a
view etcd has not answered for since (a paused etcd keeps a watch open and silent), nor on a
lease expiry before it knows whether a gap preceded it (a control-plane incident, see
control/grace.py); while a watch stream is down it reads etcd directly, as before watches.

The controller never touches processes: it writes the `plan` and the agents act on it.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from transom.checkpoint.catalog import discard_poisoned, flushed, newest_restorable, servers
from transom.common import keys
from transom.common.records import (
    Event,
    EventKind,
    JobRecord,
    Plan,
    RecordError,
    SummaryRequest,
)
from transom.common.states import JobState
from transom.control.cluster_view import WatchedCluster, read_direct
from transom.control.contact import (
    LEADER_TTL_S,
    PROBE_S,
    STALE_S,
    STANDBY_PROBE_S,
    StoreContact,
)
from transom.control.decisions import decide
from transom.control.leader_watch import LeaderWatch
from transom.control.observed import Observed
from transom.control.tick import Memory, Snapshot
from transom.job_spec import JobSpec
from transom.monitor.exporter import MonitorExporter
from transom.monitor.waiting import median_step_s
from transom.store import Store, StoreError
from transom.store.etcd_client import Lease
from transom.store.spec import SPEC_WAIT_S, read_spec
from transom.utils.net import bind_address, host_address

log = logging.getLogger("transom.controller")

TICK_S = 0.2  # the shortest time between two ticks (changes that come faster are taken together)
STEADY_TICK_S = 1.0  # while the job runs and nothing changes: the time-based rules' tick
# ... or every STEPS_PER_TICK of the job's median step time if that is shorter (but at least
# TICK_S): the straggler detector counts its latency in steps, and summaries that only carry
# new timings do not wake the controller.
STEPS_PER_TICK = 4
# A standby reads the job this often (has it ended?) if nothing woke it: a leader that ends the
# job revokes its lease on exit, and the leader key's delete wakes the standby at once.
STANDBY_RETRY_S = 30.0
STOP_CHECK_S = 0.25  # a wait checks `stopping` this often (setting it need not wake the loop)
# Before it reads a next generation's restore step, the leader waits for the members' checkpoint
# servers to send what they hold (catalog.Flushed): this long at most, looking this often.
FLUSH_WAIT_S = 1.0
FLUSH_POLL_S = 0.01
# The leader deletes from etcd the events older than EVENTS_KEPT_S, every EVENTS_PRUNE_S (one
# request): a job writes three a node a save for weeks, which would fill etcd's quota (and every
# reader of all events); the mirroring launcher's events.jsonl keeps them all.
EVENTS_KEPT_S = 3600.0
EVENTS_PRUNE_S = 60.0
PRUNE_DEADLINE_S = 1.0  # a prune never holds the leader's loop up longer


def tick_wait(started: float, now: float, due: float | None) -> tuple[float, float]:
    """After a tick that started at `started` (time.monotonic, as `now` and `due`): how long the
    loop waits before a change may wake it (changes that come faster are taken together), then
    the most it waits for one after that (math.inf: the caller's timer decides). A tick that
    asked for the next at `due` gets it then, sooner than TICK_S if need be."""
    floor = max(0.0, started + TICK_S - now)
    if due is None:
        return floor, math.inf
    floor = min(floor, max(0.0, due - now))
    return floor, max(0.0, due - now - floor)


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
        self.memory = Memory()  # the detectors' in-memory state (see tick.Memory)
        self._step_s: float | None = None  # the members' median step time, newest snapshot
        # When (time.monotonic) the newest tick asked for the next (Decision.due), or None.
        self._due: float | None = None
        self.observed = Observed()  # summary ages and store gaps, on this process's clock
        # When (time.monotonic) this controller took the lead of a job another had led, until
        # its first snapshot after that (see snapshot).
        self.took_over: float | None = None
        # (generation, when, whose) the leader began to wait for its members' flushes, and the
        # members it waits for: those with a checkpoint server registered (snapshot).
        self._flush_wait: tuple[int, float, list[str]] | None = None
        self.terminated = False  # SIGTERM: hand leadership over and exit 0
        self.wake = threading.Event()  # something changed: tick (or try to lead) now
        # News that cannot wait (a failure, a node gone, a node done: cluster_view._pressing):
        # while the job runs, tick without waiting out TICK_S (the demo's crash waited 0.2 s).
        self.pressing = threading.Event()
        self.contact = StoreContact(
            self._probe,
            self.observed,
            self.stopping,
            lambda: PROBE_S if self.leading.is_set() else STANDBY_PROBE_S,
        )
        self.view: WatchedCluster | None = None  # the leader's watched view of the agents
        self.leader_watch: LeaderWatch | None = None  # a standby's watch on the leader key
        self._prune_at = 0.0  # monotonic time of the next deletion of old events

    # -- leadership ---------------------------------------------------------------------------
    def _try_lead(self) -> bool:
        assert self.spec is not None
        lease = self.store.lease(LEADER_TTL_S)
        if not self.store.create(keys.LEADER, self.candidate_id, lease=lease):
            self.store.revoke(lease)
            return False
        self.lease = lease
        self.leading.set()
        self.contact.start()  # keeps the lease alive from now on
        self.contact.kick()  # at the leader's pace from now (it may be in a standby's wait)
        stored = self.store.get(keys.JOB)
        self.job = JobRecord.from_dict(stored) if stored else JobRecord.new(time.time())
        self.took_over = time.monotonic() if stored else None
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
        with self.contact.lock:
            since_gap = self.observed.since_gap(time.monotonic())
        if since_gap is not None and since_gap < self.spec.node_ttl_s:
            message += f", after etcd did not answer it for {self.observed.gap_s:.1f} s"
        self._commit([Event(time.time(), EventKind.LEADER, message, self.job.generation)])
        return True

    def _probe(self) -> None:
        """The steady store call (StoreContact, every PROBE_S; STANDBY_PROBE_S for a standby):
        the leader keeps its lease alive; a standby checks that a leader exists (and is woken if
        none does)."""
        lease = self.lease
        if self.leading.is_set() and lease is not None:
            if not self.store.refresh(lease):
                log.warning("leadership lease expired")
                self.leading.clear()
                self.wake.set()
        elif self.store.get(keys.LEADER) is None:
            self.wake.set()

    def _commit(self, events: list[Event], plan: Plan | None = None) -> None:
        """Write new events, the job record and the plan fenced on leadership (one transaction;
        with very many events, the record and the plan in the last one)."""
        assert self.job is not None
        self.job.updated = time.time()
        values = {}
        for e in events:
            e.controller = self.candidate_id
            values[keys.event(e.time, self.candidate_id)] = e.to_dict()
            log.info("%s: %s", e.kind.value, e.message)
        values[keys.JOB] = self.job.to_dict()
        if plan is not None:
            values[keys.PLAN] = plan.to_dict()
        if not self.store.put_if_leader(self.candidate_id, values):
            log.warning("lost leadership; not writing")
            self.leading.clear()

    def _ask(self, request: SummaryRequest) -> None:
        """Ask the members for fresh monitor summaries, fenced on leadership; a failure only
        costs the rule that waits for them its longest wait."""
        try:
            self.store.put_if_leader(self.candidate_id, {keys.SUMMARY_REQUEST: request.to_dict()})
        except StoreError as e:
            log.info("cannot ask for fresh summaries: %s", e)

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
            self._close_view()
            if self.leader_watch is not None:
                self.leader_watch.stop()
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
        self.contact.start()
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                if not self.leading.is_set():
                    self._close_view()
                    code = self._stand_by()
                    if code is not None:
                        return code
                    continue
                self._step()
                assert self.job is not None
                if self.job.state.terminal and self.leading.is_set():
                    return 0 if self.job.state is JobState.SUCCEEDED else 1
            except (StoreError, RecordError) as e:
                log.warning("store error: %s", e)
                self.stopping.wait(1.0)
            self._wait_for_change(started)
        return 0 if self.terminated else 1

    def _stand_by(self) -> int | None:
        """An attempt to lead if the leader key may be gone (woken by its delete or absence, or
        without a watch on it), then a wait until it goes (or STANDBY_RETRY_S, to see whether
        the job ended); the job's exit code if it already ended."""
        if self.leader_watch is None:
            watch = LeaderWatch(self.store, self.wake)
            if watch.start():
                self.leader_watch = watch
        may_be_gone = self.wake.is_set() or self.leader_watch is None
        self.wake.clear()  # a delete from now on wakes the wait below
        stored = self.store.get(keys.JOB)
        job = JobRecord.from_dict(stored) if stored else None
        if job and job.state.terminal:
            return 0 if job.state is JobState.SUCCEEDED else 1
        if may_be_gone and self._try_lead():
            if self.leader_watch is not None:
                self.leader_watch.stop()
                self.leader_watch = None
            return None
        self._wait_woken(STANDBY_RETRY_S)
        return None

    def _wait_for_change(self, started: float) -> None:
        """Until something changed (at least TICK_S after `started`), the timer ran out, or the
        tick the newest one asked for is due."""
        floor, limit = tick_wait(started, time.monotonic(), self._due)
        job = self.job
        running = job is not None and job.state is JobState.RUNNING
        if self._wait_floor(floor, self.pressing if running else None):
            return
        steady = (
            job is not None
            and job.state is JobState.RUNNING
            and job.next_generation is None
            and self.memory.grace_until is None
        )
        steady_s = STEADY_TICK_S
        if self._step_s is not None:
            steady_s = min(steady_s, max(TICK_S, STEPS_PER_TICK * self._step_s))
        self._wait_woken(min(limit, steady_s if steady else TICK_S))
        self.wake.clear()
        self.pressing.clear()

    def _wait_floor(self, floor: float, pressing: threading.Event | None) -> bool:
        """Wait out the tick floor, or until `pressing` is set; whether `stopping` was set."""
        if pressing is None:
            return self.stopping.wait(floor)
        self._wait_woken(floor, pressing)
        return self.stopping.is_set()

    def _wait_woken(self, timeout: float, event: threading.Event | None = None) -> None:
        """Until `event` (`wake`) is set, `stopping` is set (checked every STOP_CHECK_S) or
        `timeout`."""
        event = event or self.wake
        deadline = time.monotonic() + timeout
        while not self.stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or event.wait(min(left, STOP_CHECK_S)):
                return

    def _close_view(self) -> None:
        if self.view is not None:
            self.view.stop()
            self.view = None

    def _catch_sigterm(self) -> Callable[[int, FrameType | None], Any] | int | None:
        if threading.current_thread() is not threading.main_thread():
            return None

        def leave(signum: int, frame: FrameType | None) -> None:
            log.warning("SIGTERM: handing leadership over and exiting")
            self.terminated = True
            self.stopping.set()

        return signal.signal(signal.SIGTERM, leave)

    def snapshot(self) -> Snapshot:
        """What `decide` needs: the watched view, or, while a watch stream is down, a direct
        read of etcd (values that are not valid records are ignored)."""
        assert self.job is not None and self.spec is not None
        job = self.job
        view = self.view
        published = view.published() if view is not None and view.current else None
        if published is None:
            published = read_direct(self.store)
        members = set(job.members)  # a set: a thousand nodes' summaries are filtered each tick
        snap = Snapshot(
            nodes=published.nodes,
            statuses=published.statuses,
            summaries={n: s for n, s in published.summaries.items() if n in members},
            preflight=published.preflight,
        )
        nxt = job.next_generation
        if nxt is not None and not job.state.terminal:
            awaited = [m for m in job.members if m in published.nodes and m not in nxt.lost]
            snap.holdings_pending = self._awaiting_flushes(job.generation, awaited)
            if snap.holdings_pending:  # no tick: nothing below is taken from the I/O loop yet
                return snap
        with self.contact.lock:
            now = time.monotonic()
            snap.summary_ages = self.observed.summary_ages(
                snap.summaries, now, published.summary_arrived
            )
            snap.store_gap_s = self.observed.gap_s
            snap.since_store_gap_s = self.observed.since_gap(now)
        if self.took_over is not None:  # the first snapshot as leader
            snap.since_takeover_s, self.took_over = now - self.took_over, None
        if nxt is not None and not job.state.terminal:
            snap.restore_step = newest_restorable(
                self.store,
                len(nxt.members) * self.spec.nproc_per_node,
                before=job.rollback_before,
                lost=[*nxt.lost, *job.evicted],
            )
        return snap

    def _awaiting_flushes(self, generation: int, members: list[str]) -> bool:
        """Whether the checkpoint servers of `members` have yet to send what they held when
        `generation`'s recovery began (their memory listings are lazy: batch_writer.py), for at
        most FLUSH_WAIT_S: one that does not answer (its server restarting) leaves its listings
        as they are, at most LAZY_S old, and the ranks still agree on the newest step they all
        hold at or after the plan's (checkpoint/agreement.py). Only members with a server
        registered are waited for."""
        now = time.monotonic()
        try:
            if self._flush_wait is None or self._flush_wait[0] != generation:
                registered = servers(self.store) if members else {}
                self._flush_wait = (generation, now, [m for m in members if m in registered])
            awaited = self._flush_wait[2]
            done = flushed(self.store) if awaited else {}
        except StoreError:
            return False  # etcd cannot say: plan with the catalog as it is (read next)
        missing = [m for m in awaited if done.get(m, -1) < generation]
        if missing and now - self._flush_wait[1] >= FLUSH_WAIT_S:
            log.warning(
                "planning without the checkpoint holdings of %s (no word within %.1f s)",
                ", ".join(missing),
                FLUSH_WAIT_S,
            )
            return False
        return bool(missing)

    def _step(self) -> None:
        assert self.job is not None and self.spec is not None
        if self.view is None:
            view = WatchedCluster(self.store, self.wake, self.pressing)
            view.start()  # StoreError: retried at the next tick
            self.view = view
        # Act only on a view etcd answered for lately, and after the newest lease expiry the
        # view saw (so any gap in reaching etcd before it is known: grace.py).
        self._due = None
        if not self.contact.confirm(self.view.node_deleted_at, STALE_S):
            return
        snap = self.snapshot()
        if snap.holdings_pending:  # the restore step is read once the servers have flushed
            self._due = time.monotonic() + FLUSH_POLL_S
            return
        self._step_s = median_step_s(
            r.step_s for s in snap.summaries.values() for r in s.ranks.values()
        )
        self.exporter.update(self.job, snap.summaries)
        now = time.time()
        d = decide(self.job, snap, self.spec, now, self.memory)
        self.memory = d.memory
        for anomaly in d.anomalies:
            self.exporter.count(anomaly)
        if d.discard_poisoned is not None:
            discard_poisoned(self.store, *d.discard_poisoned)
        if d.changed:
            self.job = d.job
            self._commit(d.events, d.plan)
            self.wake.set()  # a decision often leads to the next (RECOVERING, then the plan)
        if d.ask is not None:
            self._ask(d.ask)
        if d.due is not None:
            self._due = time.monotonic() + max(0.0, d.due - now)
        self._prune_events(time.monotonic())

    def _prune_events(self, now: float) -> None:
        """Every EVENTS_PRUNE_S: delete the events older than EVENTS_KEPT_S (a failure waits
        for the next time: nothing depends on it soon)."""
        if now < self._prune_at:
            return
        self._prune_at = now + EVENTS_PRUNE_S
        cutoff = keys.events_before(time.time() - EVENTS_KEPT_S)
        try:
            self.store.with_deadline(PRUNE_DEADLINE_S).delete_range(keys.EVENTS, cutoff)
        except StoreError as e:
            log.info("cannot delete old events yet: %s", e)
