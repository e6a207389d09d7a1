"""When the launcher, playing the cluster's scheduler (`--refill-spares`), replaces a lost node.

A node is lost to the job when the controller evicts it, or sets it aside: taken for dead
before its lease expired (transom.control.set_aside), which evicts it only at that expiry, up to
a node TTL later. The kill torture (an elastic job of 2 to 3 nodes, no spare) failed where a
second agent died within that TTL: both leases expired in one tick, one node was left, and the
replacement for the first, started only then, came too late. A set-aside node is replaced at
once; if it was alive after all, it is a spare, and so is its replacement.

Simulated nodes share one machine's cores. A new node's start (its agent's and checkpoint
server's imports, its pre-flight benchmark, its warm interpreter) costs a few seconds of CPU, and
started at the eviction it competes with the restart that the eviction began: the new
generation's workers start, restore and take their first step on the same cores. The demo's
restarts that evicted a node took 0.5-1 s longer than the one that did not. So while a new
generation starts (WARMUP, or RUNNING before its first step), a replacement waits until the
job trains again: the generation has finished a step (or, for a launcher that follows the job
record alone, has run for RUNNING_S); at the latest WAIT_S after the eviction was seen. While
the job waits for nodes or on an incident (PENDING, RECOVERING) it starts at once: the restart
may need it (the kill torture: a second agent died while the first one's replacement waited,
and the job, left with one node of its two, failed).

This module only decides when; the launcher starts the node. It must never replace a node twice
or one that this launcher did not start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transom.common.records import JobRecord
from transom.common.states import JobState

# A generation running this long has trained, as far as a launcher without progress goes.
RUNNING_S = 1.0
# The longest a replacement waits for the job to train again.
WAIT_S = 5.0


@dataclass
class SpareRefill:
    """The evicted nodes of this launcher, and when each was first seen evicted."""

    replaced: set[str] = field(default_factory=set)
    seen_at: dict[str, float] = field(default_factory=dict)

    def due(
        self,
        job: JobRecord | None,
        local_nodes: list[str],
        trained_generation: int | None,
        now: float,
    ) -> list[str]:
        """The lost local nodes to replace now (each once); `trained_generation`: the newest
        generation whose members all finished a step (None when unknown)."""
        if job is None:
            return []
        lost = sorted(set(job.evicted) | set(job.set_aside))
        waiting = [n for n in lost if n in local_nodes and n not in self.replaced]
        for node in waiting:
            self.seen_at.setdefault(node, now)
        starting = job.state is JobState.WARMUP or (
            job.state is JobState.RUNNING
            and (
                trained_generation != job.generation
                if trained_generation is not None
                else now - job.since < RUNNING_S
            )
        )
        due = [n for n in waiting if not starting or now - self.seen_at[n] >= WAIT_S]
        self.replaced.update(due)
        return due
