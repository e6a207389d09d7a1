"""The enums every process compares with: a job's state, a node's worker-group state, a tier.

Values are strings (`str` enums), so records stay plain JSON and `JobState("RUNNING")` parses
what etcd holds. This module must never import another transom package.
"""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    """Where a job is in its life (driven by the controller).

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


class NodeState(str, Enum):
    """What a node agent's workers are doing for the current generation (`status/<node>`).

    IDLE        no workers (before the first plan, or stopped after losing etcd).
    SPARE       registered, not a member of the current generation: ready to replace one.
    STARTING    a member waiting for the master address, starting its workers.
    RUNNING     its workers run the current generation.
    FAILED      a worker failed (or the pre-flight did); the report carries the failures.
    SUCCEEDED   every worker of the node exited 0.
    """

    IDLE = "idle"
    SPARE = "spare"
    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"
    SUCCEEDED = "succeeded"


class Tier(str, Enum):
    """Where a checkpoint shard is held, fastest first (the server, the catalog, the loader).

    MEMORY      the node's checkpoint server holds it in shared memory.
    PEER        another node's server holds a replica in its memory (reached over TCP).
    STORAGE     a shard file in the storage directory (survives every node).
    """

    MEMORY = "memory"
    PEER = "peer"
    STORAGE = "storage"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: object) -> Tier:
        """The tier called `name`; ValueError naming the tiers when it is none of them."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(
                f"unknown tier {name!r}: one of {', '.join(t.value for t in cls)}"
            ) from None
