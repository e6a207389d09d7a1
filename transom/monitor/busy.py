"""Whether a rank that finishes no step is still at work: a few looks at it a moment apart.

A job in which no rank finishes a step looks hung, but some work outside a step is long and
legitimate, and no framework marks it: rank 0 generating samples or uploading while the others
wait at a barrier, a DataLoader's workers preparing the first batches of an epoch. Such a rank is
*busy*. Over LOOKS looks LOOK_GAP_S apart, either:
- its main thread's stack changed and that thread ran for MIN_MAIN_SHARE of the time at least; or
- its child processes (a DataLoader's workers) ran for MIN_CHILDREN_SHARE of the time.

A rank that waits for a peer does neither:
- a collective's wait keeps one stack and hardly runs;
- a spin inside one C call (a GPU synchronisation, NCCL's busy wait) runs but keeps one stack;
- a Python loop that polls for something that never comes changes its line but hardly runs.

The node's agent (transom.monitor.node) shows a busy rank in the phase BUSY_PHASE. The hang rule
then waits for it as it waits for a save (detectors.PHASE_HANG_S since its last step at most).
Once its work stops without a step, its busy mark lapses (transom.monitor.stuck_ranks) and the
hang is declared: its quiet time counts from its last step.
Unlike a phase its worker reported, busy work only holds the hang rule off: the step that ends
it keeps its timing, as a node whose steps stall at work now and then (a slow DataLoader) is a
straggler to find, not a phase to excuse.

Work whose stack is the same at every look (one long call into C: a tokenizer over a whole
dataset, a socket send) is not seen; a script marks it with `transom.monitor.phase`, or the job
takes a longer `--hang-floor`. The other way round, a Python loop that spins without sleeping
(`while not done: pass`) runs and moves between its lines: it looks like work, and if what it
waits for never comes, the hang is declared after the phase's 300 s, not the hang timeout.

What it must never do: call a rank busy from one look (one stack cannot tell a still rank from
a moving one), count the CPU of any process but the rank's and its descendants', or raise: a
process it cannot read is not busy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

# The phase a busy rank is shown in (RankSummary.phase): the hang rule treats it as any phase.
BUSY_PHASE = "busy"
# A collection looks at each rank this many times, this long apart (or as fast as the dumps come
# back): the chance that Python work shows the same stack at every look falls with each look.
# A loop whose time goes mostly to one line (a small model's forward) showed one stack at all of
# 3 looks in 2 and 5 of 30 collections here, at all of 5 in 1 of 100.
LOOKS = 5
LOOK_GAP_S = 0.0625
# A rank's main thread must run this share of the gap, its children together that share, to
# count as work: 10 % is 25 ms of the looks' 0.25 s, two and a half clock ticks; a polling loop
# that sleeps 10 ms a turn runs well under 1 %.
MIN_MAIN_SHARE = 0.1
MIN_CHILDREN_SHARE = 0.1

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Look:
    """One look at a rank: when (monotonic), its main thread's stack (most recent frame first,
    as (file, line, function)), and the CPU seconds its main thread and its children had used."""

    t: float
    stack: tuple[tuple[str, int, str], ...]
    main_cpu_s: float | None
    children_cpu_s: float | None


def main_thread_cpu_s(pid: int) -> float | None:
    """The CPU seconds (user and system) of process `pid`'s main thread (the task whose id is
    the pid), from /proc; None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat", "rb") as f:
            text = f.read(4096).decode(errors="replace")
        fields = text[text.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime and stime (fields 14, 15)
    except (OSError, ValueError, IndexError):
        return None


def children_cpu_s(pid: int) -> float | None:
    """The CPU seconds (user and system) of process `pid`'s live descendants; None when the
    process cannot be read. A child that exits between two looks takes its time with it: that
    under-counts, never over-counts."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return None
    total = 0.0
    for child in children:
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def look(pid: int, t: float, stack: Sequence[tuple[str, int, str]]) -> Look:
    """A look at `pid` taken at `t`, with the main thread's `stack` dumped then."""
    return Look(t, tuple(stack), main_thread_cpu_s(pid), children_cpu_s(pid))


def _moved(a: tuple[tuple[str, int, str], ...], b: tuple[tuple[str, int, str], ...]) -> bool:
    """Whether the stack moved from `a` to `b`; not where one is the other cut short (a dump
    read while the rank, descheduled, had written only its inner frames), nor where one is empty."""
    n = min(len(a), len(b))
    return n > 0 and a[:n] != b[:n]


def working(looks: Sequence[Look]) -> bool:
    """Whether a rank seen in `looks` (oldest first) worked between them (module doc)."""
    if len(looks) < 2:
        return False
    first, last = looks[0], looks[-1]
    span = last.t - first.t
    if span <= 0:
        return False
    if first.children_cpu_s is not None and last.children_cpu_s is not None:
        if last.children_cpu_s - first.children_cpu_s >= MIN_CHILDREN_SHARE * span:
            return True
    moved = any(_moved(a.stack, b.stack) for a, b in zip(looks, looks[1:], strict=False))
    if not moved or first.main_cpu_s is None or last.main_cpu_s is None:
        return False
    return last.main_cpu_s - first.main_cpu_s >= MIN_MAIN_SHARE * span
