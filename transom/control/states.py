"""The job's states, driven by the controller (see `Controller`)."""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    """Where a job is in its life.

    PENDING     waiting for enough healthy nodes to register.
    WARMUP      a generation's plan is written; member nodes run their pre-flight checks and
                start workers. Becomes RUNNING once every member reports its workers running.
    RUNNING     every member's workers are running generation g.
    RECOVERING  an incident (worker failure, node lost) stopped generation g; the controller
                collects the reports, decides evictions, takes spares and writes generation g+1.
    SUCCEEDED   every worker of the current generation exited 0.
    FAILED      restart budget spent, not enough nodes left, or the same user error again.
    """

    PENDING = "PENDING"
    WARMUP = "WARMUP"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED)
