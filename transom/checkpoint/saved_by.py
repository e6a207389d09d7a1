"""Which generation saved a shard: the order of saves that discards go by, with no clock.

A shard's timeline (shard_header.Timeline: job, generation, world size) names the generation that
saved it. Generations only grow, so a shard saved by a generation before G is older than anything
G saves, whatever the machines' clocks say; a discard (catalog.discard_poisoned) compares these
numbers, never times. This module only reads a timeline it is given (a missing or foreign one is
older than every generation; a malformed one was refused with its header, shard_header.py) and
never does I/O.
"""

from __future__ import annotations

from transom.checkpoint.shard_header import Timeline

UNKNOWN = -1  # older than every generation


def saved_by(timeline: Timeline | None, job: str | None = None) -> int:
    """The generation that saved a shard of `timeline` (a header's, read and checked with it);
    UNKNOWN when there is none, or (`job` given) it is another job's."""
    if timeline is None or (job is not None and timeline.job != job):
        return UNKNOWN
    return timeline.generation
