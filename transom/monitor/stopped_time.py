"""Stopped time: how long a rank's process did not run when it wanted to, wherever it was.

A rank stopped from outside (SIGSTOP, a cgroup's CPU quota used up, a starved CPU) is late in
its busy time only when the stop falls in its compute: one that falls in the all-reduce makes
both ranks wait there and neither look late. A 300 ms stop every 600 ms in a job of 60 ms steps
comes back at the same point of the step each time, so such a rank can hide for good. What a
stop always shows: the worker's monitor sender thread (transom.monitor.reporter), which sleeps
SENDER_PERIOD_S between its rounds, wakes late. Each wake later than STOPPED_MIN_S past its time
is counted as stopped (outside a phase: a checkpoint's pickling may hold Python's lock that long),
and the total so far rides on the datagrams that thread sends (`stopped`). A rank that waits in a
collective sleeps in C with the lock let go: its sender wakes on time. Scheduling noise and Python's
lock switches (5 ms) are under STOPPED_MIN_S and count for nothing.

A CPU quota (a Kubernetes CPU limit, a cgroup's CFS bandwidth) holds the rank for part of each
100 ms period, a rhythm the sender's 0.1 s round can lock onto and never see, and the throttled
time falls mostly in the collective, where no rank looks late. What shows it: the training
thread's wait on the run queue (runnable, not running: /proc schedstat's run_delay), which a
quota's throttled time, or a CPU starved by a neighbour, adds to and a SIGSTOP does not. A round
counts the larger of its late wake and the training thread's run-queue wait over the round, the
latter from RUNQ_MIN_S: a 2-core machine running three ranks keeps each waiting 10-24 ms a round
(90% of rounds), a quota of half what the rank used 50-70 ms. Waiting for Python's lock is not
run-queue time.

A round spent all in a phase counts no run-queue wait: a long phase's time is not a step's. An
evaluation is compute without the step's pauses: three ranks on two cores evaluating at once
wait on the run queue 30 ms and more a round, and whichever rank the scheduler served least
looked stopped for the window after it: in a fault-free 16-minute train_gpt run (3 nodes, an
evaluation every 100 steps) 44 of its 100 evaluations were followed by a node named the one
waited for, none for long enough to be confirmed; the false stragglers of a half hour on a
slower day (late, not slow in their compute) were most likely these. A phase shorter than a
round (a save every few steps) leaves its rounds counted: a quota's throttled time in them is
a step's.

The node agent keeps each rank's `StoppedTime`: the growth of that total, as it arrived, over
the last STOPPED_WINDOW_S (or STOPPED_WINDOW_STEPS steps, whichever is longer), less the
LARGEST_IGNORED largest increments (one hiccup of the machine), as seconds a step (`per_step`):
the controller compares it across nodes like the busy time (transom.monitor.waiting). The rate
is taken over the part of the window since its first stop began, STOPPED_MIN_SPAN_S at least:
a slowdown that began inside the window is not diluted by the time before it. A 300 ms stop
every 600 ms then reads its own rate (half a second a second) from its second stop on, 0.9 s
after it began, where over the whole window it read a quarter of that and crossed the
straggler bar only with its third or fourth stop.

What crosses the process boundary is checked: the total is a finite number >= 0 (the datagram
schema), a total that went down starts over, and no increment counts for more than the agent's
own time since the sender's previous datagram (plus a sender period). This module must never do
I/O or act: it keeps numbers.
"""

from __future__ import annotations

from collections import deque

SENDER_PERIOD_S = 0.1  # the sender thread's round (transom.monitor.reporter.ROUND_S)
STOPPED_MIN_S = 0.02  # a later wake than this is a stop (scheduling noise is a few ms)
STOPPED_WINDOW_S = 2.0
STOPPED_WINDOW_STEPS = 16
LARGEST_IGNORED = 1
# The stopped seconds are a rate over this much of the window at least (`per_step`).
STOPPED_MIN_SPAN_S = 1.0
INCREMENTS_KEPT = 256  # of a rank's newest increments (a 300 ms stop every 600 ms: 3-4 a window)


RUNQ_MIN_S = 0.03  # a round's run-queue wait of the training thread counts from this


def run_queue_s(tid: int) -> float | None:
    """The seconds thread `tid` of this process has waited on a run queue (schedstat's second
    field, in ns); None where the kernel does not say (no schedstats, another OS)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class StopMeter:
    """The worker's side: the sender thread's late wakes and the training thread's (native id
    `tid`) run-queue waits, the larger of the two each round, added up (one thread calls it)."""

    def __init__(self, tid: int | None = None) -> None:
        self.total_s = 0.0
        self.tid = tid
        self.waited_s = None if tid is None else run_queue_s(tid)  # run-queue total so far

    def woke(
        self, slept_s: float, asked_s: float, in_phase: bool, all_in_phase: bool = False
    ) -> None:
        """The thread slept `slept_s` where it asked for `asked_s`; `in_phase`: a phase was on
        at some time of the round (its late wake counts for nothing), `all_in_phase`: all of
        it (nor does its run-queue wait, which is taken as seen all the same)."""
        late = slept_s - asked_s
        counted = late if late >= STOPPED_MIN_S and not in_phase else 0.0
        if self.tid is not None:
            before, self.waited_s = self.waited_s, run_queue_s(self.tid)
            if before is not None and self.waited_s is not None and not all_in_phase:
                waited = self.waited_s - before
                counted = max(counted, waited if waited >= RUNQ_MIN_S else 0.0)
        self.total_s += counted


class StoppedTime:
    """The agent's side: one rank's stopped seconds as its datagrams told them."""

    def __init__(self) -> None:
        self.total: float | None = None  # the sender's total as last seen
        self.seen_at: float | None = None  # when (the agent's monotonic clock)
        self.since: float | None = None  # counting since (the first counted datagram)
        self.increments: deque[tuple[float, float]] = deque(maxlen=INCREMENTS_KEPT)

    def add(self, now: float, total: float, counting: bool) -> None:
        """The sender's total `total`, received at `now`; counted only while `counting` (the
        rank is past its warm-up: a generation's start is slow in many ways)."""
        previous, seen_at = self.total, self.seen_at
        self.total, self.seen_at = total, now
        if not counting or previous is None or seen_at is None or total < previous:
            return
        if self.since is None:
            self.since = now
        grown = min(total - previous, now - seen_at + SENDER_PERIOD_S)
        if grown > 0:
            self.increments.append((now, grown))

    def per_step(self, now: float, step_s: float | None) -> float | None:
        """Stopped seconds a step of `step_s` over the window ending at `now`, from the
        window's first stop on (module doc; None until the rank has been counted for a whole
        window)."""
        if step_s is None or self.since is None:
            return None
        window = max(STOPPED_WINDOW_S, STOPPED_WINDOW_STEPS * step_s)
        if now - self.since < window:
            return None
        recent = [(t, d) for t, d in self.increments if t >= now - window]
        kept = sorted(d for _, d in recent)[: max(0, len(recent) - LARGEST_IGNORED)]
        if not kept:
            return 0.0
        began = min(t - d for t, d in recent)  # when the window's first stop began
        span = min(window, max(STOPPED_MIN_SPAN_S, now - began))
        return round(sum(kept) / span * step_s, 5)
