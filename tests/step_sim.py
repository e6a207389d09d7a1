"""A simulated synchronous job on a clock, fed through the real monitor: agents' `RankTrack`s,
summaries written as the agents write them, the controller's cross-node detectors every tick.

No processes and no sockets: each rank's step is computed (its compute, the all-reduce every rank
waits in, its work after the all-reduce, a sleep between steps, a checkpoint with a barrier every
`ckpt_every` steps), its step datagram's values go to the real
`rank_timing.RankTrack.add_timing`, each
node's summary (`RankTrack.view`) is published at the agent's ticks when written (as
`NodeMonitor.steps_due` and the agent's keep-alive: when its timings shifted, after
SUMMARY_STEPS new steps (or ATTENTIVE_PERIOD_S) within ATTENTIVE_S of a shift that slowed it,
of the generation's start or of a summary slower than the spell's first (`pace.attend`),
else every `node_reports.SUMMARY_HEARTBEAT_S`),
and every controller tick the views of the latest summaries go to `cluster.StragglerDetector` and
`cluster.ThroughputDetector`. A rank can be throttled from outside as the `throttle` fault does
(stopped for part of every period, `DutyCycle`) or as a CPU quota would (`CpuQuota`).

It never sleeps: the whole job is computed, so a test runs many seeds in a second.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

from transom.control import node_reports
from transom.monitor import cluster, node, rank_timing
from transom.monitor import summary_pace as pace

CONTROLLER_TICK_S = 0.2  # transom.control.controller.TICK_S
AGENT_TICK_S = 0.2  # transom.control.agent.TICK_S: a summary is published at a tick when due


class Free:
    """A rank that runs whenever it has work."""

    def run(self, t: float, work: float) -> float:
        return t + work

    def resume(self, t: float) -> float:
        return t


class DutyCycle(Free):
    """From `start` on, stopped for the first (1 - run_fraction) of every `period_s`, as the
    `throttle` fault's SIGSTOP/SIGCONT thread does."""

    def __init__(self, start: float, run_fraction: float, period_s: float = 0.1):
        self.start, self.period = start, period_s
        self.stopped = period_s * (1.0 - run_fraction)

    def _period(self, t: float) -> int:
        return math.floor((t - self.start) / self.period + 1e-9)

    def resume(self, t: float) -> float:
        if t < self.start:
            return t
        running_from = self.start + self._period(t) * self.period + self.stopped
        return max(t, running_from)

    def run(self, t: float, work: float) -> float:
        while True:
            t = self.resume(t)
            end = self.start if t < self.start else self.start + (self._period(t) + 1) * self.period
            if t + work <= end:
                return t + work
            work -= end - t
            t = end


class CpuQuota(Free):
    """From `start` on, at most `run_fraction` x `period_s` of CPU time in every period (a CFS
    bandwidth limit, cpu.max): a rank that sleeps or waits uses none of it."""

    def __init__(self, start: float, run_fraction: float, period_s: float = 0.1):
        self.start, self.period = start, period_s
        self.quota = period_s * run_fraction
        self.used: dict[int, float] = {}

    def _period(self, t: float) -> int:
        return math.floor((t - self.start) / self.period + 1e-9)

    def resume(self, t: float) -> float:
        if t < self.start or self.used.get(self._period(t), 0.0) < self.quota - 1e-12:
            return t
        return self.start + (self._period(t) + 1) * self.period

    def run(self, t: float, work: float) -> float:
        while work > 1e-12:
            t = self.resume(t)
            if t < self.start:
                do = min(work, self.start - t)
            else:
                k = self._period(t)
                end = self.start + (k + 1) * self.period
                do = min(work, self.quota - self.used.get(k, 0.0), end - t)
                self.used[k] = self.used.get(k, 0.0) + do
            t += do
            work -= do
        return t


@dataclass
class Job:
    """What each step costs; `noise` the relative jitter of compute, `hiccups` the chance of a
    step of one rank taking HICCUP x its compute (a busy shared machine)."""

    nodes: int = 2
    compute_s: float = 0.04
    comm_s: float = 0.01
    post_s: float = 0.01  # optimizer step and logging, after the all-reduce
    sleep_s: float = 0.05  # train_gpt --step-delay
    noise: float = 0.15
    hiccups: float = 0.03
    hiccup: float = 2.5
    warmup_steps: int = 10  # the first steps are slower, by a different amount on every rank
    ckpt_every: int = 0  # a checkpoint (a phase, then a barrier) every this many steps
    ckpt_s: float = 0.3
    ckpt_aftermath: bool = False  # the step after a checkpoint slower on some ranks (its I/O)
    # An unmodified script's save (a Hugging Face Trainer's): rank 0 alone writes, the others
    # wait in a barrier, and no rank reports it as a phase, so the save's step is compared.
    ckpt_rank0_only: bool = False
    saves_timed: bool = False  # the worker bootstrap times such a save and leaves it out
    runners: dict[int, Free] = field(default_factory=dict)  # rank -> its CPU (Free by default)


@dataclass
class Outcome:
    straggler: tuple[int, list[str]] | None  # (the newest step then, the nodes blamed)
    drop: tuple[int, list[str]] | None
    cycles: list[float] = field(default_factory=list)  # rank 0's step ends' distances


def simulate(job: Job, steps: int, seed: int = 0, stop_at_straggler: bool = True) -> Outcome:
    """Run `steps` steps of `job`, one rank a node, and the monitor on them."""
    rng = random.Random(seed)
    runners = [job.runners.get(r, Free()) for r in range(job.nodes)]
    warm = [rng.uniform(0.5, 3.0) for _ in range(job.nodes)]
    datagrams: list[tuple[float, int, int, dict]] = []  # (sent, rank, step, values)
    clock = [0.0] * job.nodes
    aftermath = [0.0] * job.nodes
    for step in range(1, steps + 1):
        arrive, starts = [], list(clock)
        for r in range(job.nodes):
            c = job.compute_s * (1 + job.noise * rng.uniform(-1, 1))
            if rng.random() < job.hiccups:
                c *= job.hiccup
            if step <= job.warmup_steps:
                c *= 1 + warm[r] * (job.warmup_steps - step + 1) / job.warmup_steps
            if aftermath[r] > 0:
                c *= 1 + aftermath[r]
            arrive.append(runners[r].run(starts[r], c))
        ready = max(runners[r].resume(max(arrive)) for r in range(job.nodes))
        done = ready + job.comm_s * (1 + job.noise * rng.uniform(-1, 1))
        exits = [runners[r].resume(done) for r in range(job.nodes)]
        ends = [runners[r].run(exits[r], job.post_s) for r in range(job.nodes)]
        ckpt = job.ckpt_every > 0 and step % job.ckpt_every == 0
        ends_before_save = list(ends)
        if ckpt:
            savers = [0] if job.ckpt_rank0_only else range(job.nodes)
            saved = max(runners[r].run(ends[r], job.ckpt_s * rng.uniform(0.5, 1.5)) for r in savers)
            ends = [runners[r].resume(saved) for r in range(job.nodes)]
        for r in range(job.nodes):
            aftermath[r] = rng.uniform(0.0, 0.5) if ckpt and job.ckpt_aftermath else 0.0
            dur, comm = ends[r] - starts[r], exits[r] - arrive[r]
            if ckpt and job.ckpt_rank0_only and (r or job.saves_timed):
                comm += ends[r] - ends_before_save[r]  # in the barrier while rank 0 saves
            values = {"dur": dur, "comm": comm, "compute": max(0.0, dur - comm)}
            if ckpt and not job.ckpt_rank0_only:
                values["phase"] = ["checkpoint"]
            datagrams.append((ends[r], r, step, values))
            clock[r] = runners[r].resume(ends[r] + job.sleep_s)
    outcome = _monitor(job, datagrams, rng, stop_at_straggler)
    sent0 = [sent for sent, r, _, _ in datagrams if r == 0]
    outcome.cycles = [b - a for a, b in zip(sent0, sent0[1:], strict=False)]
    return outcome


def _monitor(job: Job, datagrams: list, rng: random.Random, stop_at_straggler: bool) -> Outcome:
    """Feed the datagrams through the agents' tracks and the controller's detectors."""
    events: list[tuple[float, int, int, tuple]] = []  # (time, order, kind, payload)
    for i, (sent, r, step, values) in enumerate(datagrams):
        events.append((sent, 0, i, (r, step, values)))
    end = max(d[0] for d in datagrams)
    for n in range(job.nodes):  # the agents' ticks, each at its own phase
        t = rng.uniform(0, AGENT_TICK_S)
        while t < end:
            events.append((t, 1, n, ()))
            t += AGENT_TICK_S
    t = 0.0
    while t < end:
        events.append((t, 2, 0, ()))
        t += CONTROLLER_TICK_S
    heapq.heapify(events)
    tracks = [rank_timing.RankTrack() for _ in range(job.nodes)]
    published: dict[int, list[dict]] = {}
    last_summary: dict[int, tuple[float, int | None]] = {}  # node -> (when, newest step)
    last_view: dict[int, node.RankSummary] = {}  # node -> its rank's view in that summary
    attentive_until = dict.fromkeys(range(job.nodes), pace.ATTENTIVE_S)  # a new generation
    spell_views: dict[int, dict[str, node.RankSummary] | None] = {}  # the spell's first summary
    straggler_detector, drop_detector = cluster.StragglerDetector(), cluster.ThroughputDetector()
    straggler = drop = None
    while events:
        now, kind, index, payload = heapq.heappop(events)
        if kind == 0:
            r, step, values = payload
            track = tracks[r]
            previous, previous_sent = track.step, track.sent_at
            track.step, track.sent_at = step, now
            track.first_step = track.first_step or step
            track.add_timing(step, values, previous, previous_sent, now)
        elif kind == 1:
            track, (at, step) = tracks[index], last_summary.get(index, (-math.inf, None))
            newest, before = track.step, last_view.get(index)
            advanced = (
                now - at >= pace.SUMMARY_MIN_PERIOD_S
                and newest is not None
                and newest > (step or 0)
            )
            shifted = advanced and track.shifted(before, now)
            if shifted and track.shifted(before, now, slower_only=True):
                attentive_until[index] = now + pace.ATTENTIVE_S
            due = (
                now - at >= node_reports.SUMMARY_HEARTBEAT_S
                or shifted
                or (
                    now < attentive_until[index]
                    and now - at >= pace.SUMMARY_MIN_PERIOD_S
                    and newest is not None
                    and (
                        (advanced and newest >= (step or 0) + pace.SUMMARY_STEPS)
                        or now - at >= pace.ATTENTIVE_PERIOD_S
                    )
                )
            )
            if due:  # as NodeMonitor.steps_due and NodeReports.summary
                last_summary[index] = (now, newest)
                last_view[index] = track.view(now)
                attentive_until[index], spell_views[index] = pace.attend(
                    attentive_until[index],
                    spell_views.get(index),
                    {str(index): last_view[index]},
                    now,
                )
                published[index] = [
                    {**last_view[index].to_dict(), "node": f"node{index}", "rank": index}
                ]
        else:
            views = [v for n in sorted(published) for v in published[n]]
            if not views:
                continue
            at = cluster.ClusterView(views, now, 10.0, finishing=False)
            found = straggler_detector.update(at)
            if found is not None and straggler is None:
                straggler = (found.step, found.nodes)
                if stop_at_straggler:
                    break
            found = drop_detector.update(at)
            if found is not None and drop is None:
                drop = (max(v["step"] for v in views), found.nodes)
    return Outcome(straggler, drop)


def slowdown(cycles: list[float], at: int, span: int = 15) -> float:
    """The job's median cycle in `span` steps after step `at` over the `span` before it
    (cycles[i] ends step i + 2)."""
    before, after = cycles[at - 2 - span : at - 2], cycles[at : at + span]
    return statistics.median(after) / statistics.median(before)
