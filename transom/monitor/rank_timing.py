"""One rank's timing window in the node agent's monitor, and the summary of it the agent publishes.

The agent (transom.monitor.node) feeds each checked step datagram of a rank to its `RankTrack`:
step duration, compute and sync-section ("wait") times, and the rank's *busy* time (from the end of
one step to the end of the next, less the wait: what its peers wait for). Over TIMING_WINDOW steps
it keeps medians and trimmed means (a delay that hits only some steps counts in proportion, the
machine's hiccups are left out); over the longer STALL_WINDOWS it counts *stalls*, steps whose
busy time stands above the rank's median by STALL_FRACTION of a step: a rank stopped for 300 ms
every 600 ms (a duty cycle longer than a step) is late in one step of four or five, which the
trimmed mean drops as hiccups. `stall_s` is the stalls' excess busy time per step over a long
window, less the HICCUPS_IGNORED largest stalls: a machine's hiccups (one or two a window) count
for nothing, a stall that recurs every few steps for nearly all of its time. Two windows, the
larger result: 16 steps find a stall that recurs every 3-4 steps soon; one every 5 steps leaves
16 steps with 3 stalls, 1 counted, which for a 300 ms stop in 68 ms steps is the bar itself (a
Trainer job's 300/300 ms shape sat there, found in 9 of 17), where 24 steps hold 4-5 (1.9x the
bar). A window counts once full (a generation's first steps are slower by different amounts on
each rank, which a part-full long window took for stalls). The controller compares it across
nodes like the busy time (transom.monitor.waiting), and so is its stopped time
(transom.monitor.stopped_time, a step as long as the mean of its latest cycles). It also keeps
the rank's FINGERPRINTS_KEPT newest replica fingerprints (transom.monitor.fingerprint) for the
summary.

This module must never do I/O or act: it keeps numbers and summarises them.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

from transom.common.records import RankSummary
from transom.monitor import busy, datagram, detectors, waiting
from transom.monitor.stopped_time import StoppedTime

WARMUP_STEPS = 5  # the first steps of each generation are not compared (start-up, caches)
TIMING_WINDOW = 8  # comparable steps in a rank's timing statistics
MIN_TIMING_SAMPLES = 5
# Compute and busy times: the mean of the window less its TRIM_HIGH highest and TRIM_LOW lowest
# (of a full window; as many in proportion of one not yet full).
TRIM_HIGH = 3
TRIM_LOW = 1
# Stalls: over the last W steps, a step whose busy time is above the window's median busy time
# by STALL_FRACTION of the median step time; the HICCUPS_IGNORED largest count for nothing. For
# each W of STALL_WINDOWS, once that many steps are in: the larger result.
STALL_WINDOWS = (16, 24)
STALL_FRACTION = 0.5
HICCUPS_IGNORED = 2
FINGERPRINTS_KEPT = 3


class RankTrack:
    """What one rank reported in this generation."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.first_step: int | None = None
        self.step_at: float | None = None  # monotonic time of the last step report
        self.beat_at: float | None = None
        self.phase: str | None = None
        # Until when (monotonic) the rank counts as at work outside a step, as its agent's last
        # looks at it found (transom.monitor.busy); -inf: not seen at work since its step.
        self.busy_until = -math.inf
        self.durations: deque[float] = deque(maxlen=TIMING_WINDOW)
        self.computes: deque[float] = deque(maxlen=TIMING_WINDOW)
        self.waits: deque[float] = deque(maxlen=TIMING_WINDOW)  # time in the sync section
        # Time between the ends of consecutive steps less the wait: compute and anything the rank
        # did (or was stopped in) between steps; its peers wait for this much.
        # (The newest max(STALL_WINDOWS), for stalls; the timing window is the newest
        # TIMING_WINDOW.)
        self.busies: deque[float] = deque(maxlen=max(STALL_WINDOWS))
        self.cycles: deque[float] = deque(maxlen=max(STALL_WINDOWS))  # the same, with the wait
        self.fingerprints: dict[str, str] = {}  # step -> digest, the newest FINGERPRINTS_KEPT
        # step -> a replayed fingerprint step's deviations (transom.monitor.evidence), of those
        self.deviations: dict[str, list[list[int | float]]] = {}
        self.sent_at: float | None = None  # the sender's time of the last step datagram
        self.losses: deque[float] = deque(maxlen=detectors.LOSS_WINDOW)
        self.tokens_per_s: float | None = None
        self.gap_raised = False
        self.stopped = StoppedTime()  # the time its process did not run (stopped_time)

    def add_timing(
        self,
        step: int,
        m: dict,
        previous: int | None,
        previous_sent: float | None,
        sent: float | None,
    ) -> bool:
        """Take in step `step`'s timings (a checked step datagram's values `m`, sent at `sent` on
        the worker's clock, after step `previous` sent at `previous_sent`); False when the step is
        not comparable (no timing, a phase such as a checkpoint or evaluation, a warm-up step)."""
        if m.get("dur") is None or m.get("phase") or step < (self.first_step or 0) + WARMUP_STEPS:
            return False
        duration = m["dur"]
        self.durations.append(duration)
        compute = m.get("compute")
        self.computes.append(duration if compute is None else compute)
        comm = m.get("comm")
        wait = comm if comm is not None else duration - self.computes[-1]
        self.waits.append(wait)
        if previous == step - 1 and sent is not None and previous_sent is not None:
            cycle = sent - previous_sent  # one sender's clock: the two ends of consecutive steps
            if 0.0 <= cycle <= datagram.MAX_SECONDS:
                self.busies.append(max(0.0, cycle - wait))
                self.cycles.append(cycle)
        return True

    def add_stopped(self, now: float, total: float) -> None:
        """Its sender's stopped seconds so far, received at `now`: counted once past warm-up."""
        self.stopped.add(now, total, counting=bool(self.durations))

    def stopped_s(self, now: float) -> float | None:
        """Its stopped seconds a step over the window ending at `now`: a step as long as the
        mean time between the ends of its latest steps (stops lengthen it; the median step
        duration would not see one stop in five steps)."""
        if self.cycles:
            step_s: float | None = statistics.fmean(self.cycles)
        else:
            step_s = statistics.median(self.durations) if self.durations else None
        return self.stopped.per_step(now, step_s)

    def shifted(self, published: RankSummary | None, now: float, slower_only: bool = False) -> bool:
        """Whether its timings shifted by `now` since `published`, its view in the node's last
        summary (with `slower_only`: grew, waiting.timings_shifted)."""
        return waiting.timings_shifted(
            published,
            self.busy_s(),
            _trimmed_mean(self.computes),
            self.stall_s(),
            self.stopped_s(now),
            slower_only,
        )

    def busy_s(self) -> float | None:
        """The trimmed mean busy time over the timing window."""
        return _trimmed_mean(list(self.busies)[-TIMING_WINDOW:])

    def stall_s(self) -> float | None:
        """The stalls' excess busy time per step over each of STALL_WINDOWS, less the
        HICCUPS_IGNORED largest stalls: the largest result (None before the shortest window is
        full: a generation's first steps are slow by different amounts on each rank)."""
        busies = list(self.busies)
        if len(busies) < min(STALL_WINDOWS) or not self.durations:
            return None
        floor = STALL_FRACTION * statistics.median(self.durations)
        worst = 0.0
        for window in STALL_WINDOWS:
            if len(busies) < window:
                continue
            recent = busies[-window:]
            typical = statistics.median(recent)
            stalls = sorted(b - typical for b in recent if b - typical >= floor)
            kept = stalls[: max(0, len(stalls) - HICCUPS_IGNORED)]
            worst = max(worst, sum(kept) / window)
        return round(worst, 5)

    def add_fingerprint(
        self, step: int, digest: str, deviations: list[list[int | float]] | None = None
    ) -> None:
        self.fingerprints[str(step)] = digest
        self.deviations.pop(str(step), None)
        if deviations is not None:
            self.deviations[str(step)] = deviations
        while len(self.fingerprints) > FINGERPRINTS_KEPT:
            oldest = min(self.fingerprints, key=int)
            del self.fingerprints[oldest]
            self.deviations.pop(oldest, None)

    def view(self, now: float, where: str | None = None) -> RankSummary:
        return RankSummary(
            where=where,
            step=self.step,
            phase=self.phase or (busy.BUSY_PHASE if now < self.busy_until else None),
            step_age=round(now - self.step_at, 3) if self.step_at is not None else None,
            beat_age=round(now - self.beat_at, 3) if self.beat_at is not None else None,
            step_s=round(statistics.median(self.durations), 5) if self.durations else None,
            compute_s=_trimmed_mean(self.computes),
            wait_s=_median(self.waits),
            busy_s=self.busy_s(),
            stall_s=self.stall_s(),
            stopped_s=self.stopped_s(now),
            fingerprints=dict(self.fingerprints),
            deviations=dict(self.deviations),
            tokens_per_s=self.tokens_per_s,
        )


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 5) if len(values) >= MIN_TIMING_SAMPLES else None


def _trimmed_mean(values: Sequence[float]) -> float | None:
    """The mean without the TRIM_HIGH highest and TRIM_LOW lowest values: a delay that hits only
    some steps (a rank stopped from outside now and then) counts in proportion, where a median
    would ignore it until it hits half of the steps; the hiccups of a busy machine are left out."""
    if len(values) < MIN_TIMING_SAMPLES:
        return None
    low, high = (len(values) * trim // TIMING_WINDOW for trim in (TRIM_LOW, TRIM_HIGH))
    kept = sorted(values)[low : len(values) - high]
    return round(statistics.fmean(kept), 5)
