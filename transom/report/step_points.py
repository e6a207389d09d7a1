"""When a run's generations reached which step: the points a report times its training by.

Each point is (time, generation, step): the time by which every rank of that generation had
finished that step. They come from
- the launcher's progress records (`progress.jsonl`): at their `step_at`, when the members'
  agents saw the step reached, else when the record was written (which lags by the agents'
  summary period and the launcher's poll, up to a second at every restart); and the generation's
  first step at its `first_step_at` (the records come twice a second: the first one of a
  generation is often several steps past its first);
- fault injections (the step their target rank had reached) and sdc anomalies (every rank had
  finished the fingerprinted step);
- checkpoint saves (`checkpoint` events, action `saved`): a step every rank of the generation
  saved, at the last save; a generation's last step before a fault, or the job's last, is
  often seen here first.

Only a run with progress records gets points. This module maps records to points; it must never
read files or decide what the points mean (transom.report.analysis does).
"""

from __future__ import annotations

import math

from transom.common.records import Event, EventKind

Point = tuple[float, int | None, int]


def step_points(
    events: list[Event], progress: list[dict] | None, started: list[tuple[int, float]]
) -> list[Point]:
    """The points of a run; `started`: each generation's (number, start time)."""
    points: list[Point] = [
        (_reached_at(p), p.get("generation"), p["step"])
        for p in progress or []
        if p.get("step") is not None
    ]
    if not points:
        return []
    points += [first for p in progress or [] if (first := _first_point(p)) is not None]
    points += [
        (e.time, e.generation, e.step)
        for e in events
        if (e.kind == EventKind.FAULT or _fingerprinted(e)) and e.step is not None
    ]
    return points + _saved_points(events, started)


def finite_time(value: object) -> float | None:
    """`value` as a time where a run's file holds a finite number there (not a bool); else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _reached_at(sample: dict) -> float:
    """When a progress record's step was reached: its `step_at` where that is a number, no later
    than the record's own time; else the record's time."""
    at, written = finite_time(sample.get("step_at")), sample["time"]
    return written if at is None else min(at, written)


def _first_point(sample: dict) -> Point | None:
    """A progress record's first step of its generation, where it names one and a time (no later
    than the record's own), each of the right type; else None."""
    step, at = sample.get("first_step"), finite_time(sample.get("first_step_at"))
    if not isinstance(step, int) or isinstance(step, bool) or at is None:
        return None
    return min(at, sample["time"]), sample.get("generation"), step


def _fingerprinted(event: Event) -> bool:
    """An sdc anomaly: every rank had finished its step (the fingerprints of all were in)."""
    return event.kind == EventKind.ANOMALY and event.type == "sdc"


def _saved_points(events: list[Event], started: list[tuple[int, float]]) -> list[Point]:
    """Checkpoint saves: a step that every rank saving in a generation (the one started last
    before the save) saved, at the last save's time."""
    saves: dict[tuple[int, int], dict[int, float]] = {}
    for e in events:
        rank = e.extra.get("rank")
        if e.kind == EventKind.CHECKPOINT and e.action == "saved" and e.step is not None:
            before = [number for number, at in started if at <= e.time]
            if before and isinstance(rank, int) and not isinstance(rank, bool):
                saves.setdefault((max(before), e.step), {})[rank] = e.time
    world: dict[int, set[int]] = {}
    for (generation, _), ranks in saves.items():
        world.setdefault(generation, set()).update(ranks)
    return [(max(r.values()), g, step) for (g, step), r in saves.items() if set(r) == world[g]]
