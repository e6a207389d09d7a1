"""The node agent's monitor: receives its workers' reports, runs the per-rank detectors, publishes.

Workers send step timings, metrics, phases, heartbeats and fired faults as datagrams (see
transom.monitor.reporter) to the node's monitor channel, a Unix datagram socket in a private
directory (transom.monitor.channel); the raw samples stay here. Every datagram is checked at the
boundary: against the schema (transom.monitor.datagram), then its sender's uid, its generation
(the current one) and its rank (one of this node's ranks in this generation, `expect_ranks`).
A datagram that fails is counted (the summary's `datagrams` counters) and dropped: it never
raises, never stops the listener and never makes an anomaly.

The agent calls `tick()` every loop: it scans new worker log lines against the failure
patterns, checks heartbeats and GPUs, writes an `anomaly` event for each new anomaly, and
publishes a compact summary to `monitor/<node>` (at most every SUMMARY_PERIOD_S, at once when
there is a new anomaly): per rank the newest step, the ages of the last step and heartbeat, the
phase (`busy` for a rank found at work outside a step: transom.monitor.stuck_ranks), and median
step, compute and wait (sync section) times. The controller compares nodes from these summaries
(who the others wait for: transom.monitor.waiting).
A datagram that brings news (an anomaly, a fired fault, or steps that make a summary due), and
stuck ranks' stacks once collected, call `wake`, so that the agent's loop publishes them at once
rather than at its next tick: the agent can then tick slowly while its workers run steadily
(issue 44).

This module never stops or restarts anything: it reports, the controller decides.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from transom.common.records import (
    Anomaly,
    Event,
    MonitorSummary,
    RankSummary,
    Severity,
    SummaryRequest,
)
from transom.monitor import datagram, detectors
from transom.monitor.channel import ChannelSocket, Received
from transom.monitor.collect import LogScanner, Nvml, gpu_problems, host_metrics
from transom.monitor.rank_timing import RankTrack
from transom.monitor.stuck_ranks import StuckRanks
from transom.monitor.summary_pace import (
    ATTENTIVE_PERIOD_S,
    ATTENTIVE_S,
    FINGERPRINT_MIN_PERIOD_S,
    SUMMARY_MIN_PERIOD_S,
    SUMMARY_PERIOD_S,
    SUMMARY_STEPS,
    attend,
)

HARDWARE_PERIOD_S = 5.0
ANOMALIES_KEPT = 20
FIRED_FAULTS_KEPT = 100  # fired faults waiting for the agent's next tick
DROP_LOG_PERIOD_S = 60.0

log = logging.getLogger("transom.monitor")

# The channel's counters: datagrams accepted, and dropped by reason (the parser's three first).
ACCEPTED = "accepted"
FOREIGN_SENDER = "foreign_sender"  # another uid (the socket's directory should prevent it)
STALE_GENERATION = "stale_generation"
FOREIGN_RANK = "foreign_rank"  # not one of this node's ranks in this generation
ERROR = "error"  # a bug in handling a valid datagram: counted, logged, the listener goes on
COUNTERS = (
    ACCEPTED,
    datagram.OVERSIZE,
    datagram.NOT_JSON,
    datagram.INVALID,
    FOREIGN_SENDER,
    STALE_GENERATION,
    FOREIGN_RANK,
    ERROR,
)


class NodeMonitor:
    """Per-node signal collection and per-rank detection; one per agent."""

    def __init__(
        self,
        node_id: str,
        scope: str = "",
        hang_floor_s: float = math.inf,
        script: str = "",
        nvml=None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        """`scope` (the job's run directory) and the node id name the channel's directory;
        the job's hang floor and script tell when and how to take stuck ranks' stacks; `wake`
        (called from the listener thread) wakes the agent's loop for news."""
        self.node_id = node_id
        self.wake = wake
        self.nvml = nvml if nvml is not None else Nvml()
        self.channel = ChannelSocket(node_id, scope)
        self.socket_path = self.channel.path  # what workers get in env.MONITOR_SOCKET
        self.generation = 0
        self.answers = ""  # the newest summary request answered (MonitorSummary.answers)
        self.expected_ranks: frozenset[int] = frozenset()
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._dropped_logged_at = -DROP_LOG_PERIOD_S
        self.ranks: dict[int, RankTrack] = {}
        self.anomalies: list[Anomaly] = []  # this generation's, newest last
        self.fired_faults: list[
            tuple[dict, int, int | None, float]
        ] = []  # (fault, rank, step, time)
        self._pending: list[Anomaly] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._scanner = LogScanner()
        self._published_at = 0.0
        self._published_step: int | None = None  # the newest step in the last summary
        self._published_views: dict[str, RankSummary] = {}  # rank -> its view in the last summary
        self._attentive_until = -math.inf  # the SUMMARY_STEPS rule holds until then (monotonic)
        # The ranks' views in the first summary of this attentive spell (or since it was last
        # extended): a rank slower than there by the bar extends it (`attend`).
        self._attentive_views: dict[str, RankSummary] | None = None
        self._hardware_at = 0.0
        self._gpus: list[dict] = []
        self._host: dict = {}
        self._seq = 0
        # Where stuck ranks are and which are at work (transom.monitor.stuck_ranks); a
        # collection's results wake the agent's loop, to publish them at once.
        self.stuck = StuckRanks(hang_floor_s, script, done=wake)
        self.listener = threading.Thread(target=self._serve, name="monitor-listener", daemon=True)
        self.listener.start()

    # -- receiving ----------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                received = self.channel.receive()
            except OSError:
                return  # closed
            if received is None:
                continue
            try:
                dropped = self._handle(received, time.monotonic())
            except Exception:  # noqa: BLE001 - the listener must outlive any datagram
                log.exception("monitor channel: a datagram could not be handled")
                with self._lock:
                    self.counts[ERROR] += 1
                continue
            if dropped is not None:
                self._log_drop(dropped)
            elif self.wake is not None and self._news(time.monotonic()):
                self.wake()

    def _handle(self, received: Received, now: float) -> datagram.Rejection | None:
        """Check one datagram and take it in; the rejection if it was dropped."""
        if received.uid is not None and received.uid != os.geteuid():
            verdict: datagram.Message | datagram.Rejection = datagram.Rejection(
                FOREIGN_SENDER, f"uid {received.uid}"
            )
        elif received.truncated:
            verdict = datagram.Rejection(datagram.OVERSIZE, "longer than the receive buffer")
        else:
            verdict = datagram.parse(received.data)
        with self._lock:
            if isinstance(verdict, datagram.Message):
                if verdict.generation != self.generation:
                    verdict = datagram.Rejection(STALE_GENERATION, f"gen {verdict.generation}")
                elif verdict.rank not in self.expected_ranks:
                    verdict = datagram.Rejection(FOREIGN_RANK, f"rank {verdict.rank}")
                else:
                    self._receive(verdict, now)
                    self.counts[ACCEPTED] += 1
                    return None
            self.counts[verdict.reason] += 1
            return verdict

    def _news(self, now: float) -> bool:
        """Whether what arrived is for the agent's loop now: an anomaly, a fired fault, or
        steps that make a summary due (`steps_due`)."""
        with self._lock:
            if self._pending or self.fired_faults:
                return True
        return self.steps_due(now)

    def _log_drop(self, rejection: datagram.Rejection) -> None:
        now = time.monotonic()
        if now - self._dropped_logged_at < DROP_LOG_PERIOD_S:
            return
        self._dropped_logged_at = now
        with self._lock:
            counts = {k: v for k, v in self.counts.items() if v}
        log.warning(
            "monitor channel of %s dropped a datagram (%s: %s); counts so far %s",
            self.node_id,
            rejection.reason,
            rejection.detail,
            counts,
        )

    def _receive(self, d: datagram.Message, now: float) -> None:
        r = self.ranks.setdefault(d.rank, RankTrack())
        r.beat_at = now
        v = d.values
        if v.get("stopped") is not None:  # of a steps, beat or phase datagram
            r.add_stopped(now, v["stopped"])
        if d.kind in ("beat", "phase"):
            ended = r.phase is not None and v.get("phase") is None
            r.phase = v.get("phase")
            if ended and r.step_at is not None:
                # A phase's end is progress: the hang clock starts again from it, not from the
                # step before the phase (a long evaluation's end would be a hang at once, and a
                # script whose last step came before it ends without another).
                r.step_at = max(r.step_at, now)
        elif d.kind == "fault":
            if len(self.fired_faults) < FIRED_FAULTS_KEPT:
                when = d.t if d.t is not None else time.time()
                self.fired_faults.append((v["fault"], d.rank, v.get("step"), when))
        elif d.kind == "step":
            self._step(d.rank, r, v, now, d.t)
        elif d.kind == "fingerprint":
            r.add_fingerprint(v["step"], v["fp"], v.get("dev"))
        elif d.kind == "steps":
            for record in v["steps"]:
                self._step(d.rank, r, record.values, now, record.t)

    def _step(self, rank: int, r: RankTrack, m: dict, now: float, sent: float | None) -> None:
        """A step datagram's values (checked: see transom.monitor.datagram.SCHEMA["step"])."""
        step = m["step"]
        previous, previous_sent = r.step, r.sent_at
        r.step, r.step_at, r.sent_at = step, now, sent
        # A step ends the rank's work outside a step. That step keeps its timing: a node whose
        # steps stall now and then at work (a slow DataLoader) is a straggler to find.
        r.busy_until = -math.inf
        if r.first_step is None:
            r.first_step = step
        loss = m.get("loss")
        found = detectors.numerics(self.node_id, rank, step, loss, r.losses)
        if found is not None:
            self._pending.append(found)
        elif loss is not None:
            r.losses.append(loss)
        if not r.add_timing(step, m, previous, previous_sent, sent):
            return
        if m.get("tokens"):
            duration = m["dur"]
            rate = m["tokens"] / duration if duration > 0 else math.inf
            r.tokens_per_s = round(rate, 1) if math.isfinite(rate) else None

    # -- the agent's side ---------------------------------------------------------------------
    def new_generation(self, generation: int) -> None:
        """A new generation: forget the old one's ranks; no rank is accepted until expect_ranks."""
        with self._lock:
            self.generation = generation
            self.expected_ranks = frozenset()
            self.ranks.clear()
            self._published_step = None
            self._published_views = {}
            # The straggler detector learns the generation's baseline from its first steps.
            self._attentive_until = time.monotonic() + ATTENTIVE_S
            self._attentive_views = None
            self.anomalies = []
            self._pending.clear()
            self.stuck.reset()

    def expect_ranks(self, ranks: list[int], stacks_dir: Path | None = None) -> None:
        """This node's global ranks in the current generation: datagrams of others are dropped.
        `stacks_dir`: where their bootstrap's stack dump handler writes (None: there is none)."""
        with self._lock:
            self.expected_ranks = frozenset(ranks)
            self.stuck.stacks_dir = stacks_dir

    def excuse(self, seconds: float) -> None:
        """The agent paused the workers for `seconds`: their silence then is not theirs (no
        step, heartbeat or telemetry gap is counted over it)."""
        with self._lock:
            for r in self.ranks.values():
                r.step_at = r.step_at + seconds if r.step_at is not None else None
                r.beat_at = r.beat_at + seconds if r.beat_at is not None else None

    def counters(self) -> dict[str, int]:
        """The channel's counters: datagrams accepted, and dropped by reason (see COUNTERS)."""
        with self._lock:
            return dict(self.counts)

    def newest_step(self) -> int | None:
        with self._lock:
            steps = [r.step for r in self.ranks.values() if r.step is not None]
        return max(steps) if steps else None

    def steps(self) -> dict[int, int | None]:
        with self._lock:
            return {rank: r.step for rank, r in self.ranks.items()}

    def raise_anomaly(self, anomaly: Anomaly) -> None:
        with self._lock:
            self._pending.append(anomaly)

    def take_fired_faults(self) -> list[tuple[dict, int, int | None, float]]:
        with self._lock:
            fired, self.fired_faults = self.fired_faults, []
        return fired

    def check(self, pids: dict[int, int], logs: dict[int, Path]) -> None:
        """Run the polling detectors: log lines, heartbeats of live workers, GPUs."""
        for rank, pattern, line in self._scanner.poll(logs):
            if Severity(pattern.severity) is not Severity.INFO:
                self.raise_anomaly(detectors.log_signature(self.node_id, rank, pattern, line))
        now = time.monotonic()
        with self._lock:
            for rank, pid in pids.items():
                r = self.ranks.get(rank)
                if r is None or r.beat_at is None:
                    continue
                age = now - r.beat_at
                # The process's state matters only to a beat older than the shorter gap.
                state = _process_state(pid) if age >= detectors.HEARTBEAT_GAP_S else None
                gap = detectors.telemetry_gap(self.node_id, rank, age, state)
                if gap is not None and not r.gap_raised:
                    self._pending.append(gap)
                r.gap_raised = gap is not None
        self._check_stuck(pids, now)
        if now - self._hardware_at >= HARDWARE_PERIOD_S:
            self._hardware_at = now
            self._host = host_metrics()
            gpus = self.nvml.read()
            for type_, message, hardware in gpu_problems(self._gpus, gpus):
                self.raise_anomaly(
                    Anomaly(
                        type_,
                        Severity.CRITICAL if hardware else Severity.WARNING,
                        message,
                        [self.node_id],
                        [],
                        {"gpus": gpus},
                        hardware=hardware,
                    )
                )
            self._gpus = gpus

    def _check_stuck(self, pids: dict[int, int], now: float) -> None:
        """Look at the ranks while none steps (transom.monitor.stuck_ranks)."""
        with self._lock:
            request = self.stuck.due(self.ranks, pids, self.generation, now)
        if request is not None:
            self.stuck.look(request)

    @property
    def stuck_check_at(self) -> float | None:
        """When the agent must tick for the next look at its ranks, if none steps till then."""
        return self.stuck.check_at

    def due(self, now: float) -> bool:
        """Whether a summary is to be collected: new anomalies, stuck ranks' places the last one
        did not carry (a stopped rank's hang waits for them), its period, or `steps_due`."""
        with self._lock:
            if self._pending or now - self._published_at >= SUMMARY_PERIOD_S:
                return True
            if self.stuck.news(self.ranks, self.generation, self._published_views, now):
                return True
        return self.steps_due(now)

    def answer(self, asked: SummaryRequest | None) -> bool:
        """Whether the next summary answers `asked`, the controller's newest request (this
        generation's, not answered yet); it then carries its id."""
        if asked is None or asked.generation != self.generation or asked.id == self.answers:
            return False
        self.answers = asked.id
        return True

    def steps_due(self, now: float) -> bool:
        """Whether a rank has a replica fingerprint the last summary did not carry (at most
        every FINGERPRINT_MIN_PERIOD_S), or, at most every SUMMARY_MIN_PERIOD_S: advanced at all
        and its timings shifted (RankTrack.shifted), or, within ATTENTIVE_S of a shift that
        slowed a rank (or of the generation's start), advanced SUMMARY_STEPS steps since the
        last summary (or ATTENTIVE_PERIOD_S passed since it). Such a summary is written even if
        nothing else in it changed."""
        if now - self._published_at < FINGERPRINT_MIN_PERIOD_S:
            return False
        with self._lock:
            newest = max((r.step for r in self.ranks.values() if r.step is not None), default=None)
            if newest is None:
                return False
            advanced = newest > (self._published_step or 0)
            views = [(t, self._published_views.get(str(r))) for r, t in self.ranks.items()]
            if any(  # a new replica fingerprint: the controller compares them as they come
                view is None or not track.fingerprints.keys() <= view.fingerprints.keys()
                for track, view in views
                if track.fingerprints
            ):
                return True
            if now - self._published_at < SUMMARY_MIN_PERIOD_S:
                return False
            if advanced and any(track.shifted(view, now) for track, view in views):
                # Attentive only when a rank got slower: one that got faster again (noise, or a
                # straggler recovering) is news once, and lags nobody.
                if any(track.shifted(view, now, slower_only=True) for track, view in views):
                    self._attentive_until = now + ATTENTIVE_S
                return True
            if now >= self._attentive_until:
                return False
            steps = advanced and newest >= (self._published_step or 0) + SUMMARY_STEPS
            return steps or now - self._published_at >= ATTENTIVE_PERIOD_S

    def collect(self) -> tuple[MonitorSummary, list[Event]]:
        """(the summary to publish, the new anomalies' events)."""
        now_mono, now = time.monotonic(), time.time()
        with self._lock:
            new = []
            for a in self._pending:
                self._seq += 1
                a.id = f"{self.node_id}-{self.generation}-{self._seq}"
                a.generation = self.generation
                new.append(a)
            self._pending.clear()
            self.anomalies = (self.anomalies + new)[-ANOMALIES_KEPT:]
            where = self.stuck.where(self.ranks, self.generation)
            summary = MonitorSummary(
                node=self.node_id,
                generation=self.generation,
                t=now,
                ranks={
                    str(rank): r.view(now_mono, where.get(rank))
                    for rank, r in sorted(self.ranks.items())
                },
                anomalies=list(self.anomalies),
                host=self._host,
                gpus=[
                    {k: g.get(k) for k in ("index", "util", "temperature", "memory_used")}
                    for g in self._gpus
                ],
                datagrams=dict(self.counts),
                answers=self.answers,
            )
        self._published_at = now_mono
        self._published_views = dict(summary.ranks)
        self._attentive_until, self._attentive_views = attend(
            self._attentive_until, self._attentive_views, summary.ranks, now_mono
        )
        self._published_step = max(
            (int(r.step) for r in summary.ranks.values() if r.step is not None), default=None
        )
        events = [Event.of_anomaly(a, now, writer=self.node_id) for a in new]
        return summary, events

    def close(self) -> None:
        self._stop.set()
        self.channel.close()


def _process_state(pid: int) -> str | None:
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None
