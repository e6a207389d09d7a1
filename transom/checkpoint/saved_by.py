"""Which generation saved a shard: the order of saves that discards go by, with no clock.

A shard's timeline (shard_header.Timeline: job, generation, world size) names the generation that
saved it. Generations only grow, so a shard saved by a generation before G is older than anything
G saves, whatever the machines' clocks say; a discard (catalog.discard_poisoned) compares these
numbers, never times. This module only reads a timeline it is given: it never trusts one (a
missing, malformed or foreign timeline is older than every generation) and never does I/O.
"""

from __future__ import annotations

from typing import Any

from transom.checkpoint.shard_header import Timeline

UNKNOWN = -1  # older than every generation


def saved_by(timeline: Any, job: str | None = None) -> int:
    """The generation that saved a shard of `timeline` (a header's `Timeline`, or a catalog
    entry's JSON, which names its generation the same way); UNKNOWN when it is missing or
    malformed, or (`job` given) of another job."""
    if isinstance(timeline, Timeline):
        return timeline.generation if job is None or timeline.job == job else UNKNOWN
    if not isinstance(timeline, dict) or (job is not None and timeline.get("job") != job):
        return UNKNOWN
    generation = timeline.get("generation")
    return generation if type(generation) is int else UNKNOWN
