"""A worker's report of a bad copy of a shard: `BadCopy`, the fields of its `bad-copy` event.

The engine (engine.py) reports one whenever a copy a tier located fails to read or verify, as a
checkpoint event (worker_protocol.Event) that its node's server publishes; the server
(worker_service.py) also withdraws a copy reported corrupt from the catalog. The fields cross
the worker's socket, so the server reads them with `BadCopy.from_dict` (record_base: a missing
field or one of the wrong type is a `RecordError`, and so is a negative step or rank). The
event's JSON keys are what they always were: step, rank, tier, error, holder_node, corrupt.
This module never does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from transom.common.record_base import Record, RecordError

BAD_COPY = "bad-copy"  # the event's action


@dataclass(frozen=True)
class BadCopy(Record):
    """Rank `rank`'s copy of `step` in `tier` (a `Tier`'s name, or a registered tier's own:
    tiers.py), held by `holder_node` (None: none named), did not load: `error` says why, and
    `corrupt` whether the copy itself is bad (its header or checksums), not just unreachable."""

    step: int
    rank: int
    tier: str
    error: str = ""
    holder_node: str | None = None
    corrupt: bool = False

    def __post_init__(self) -> None:
        if self.step < 0 or self.rank < 0:
            raise RecordError(f"BadCopy: step {self.step} rank {self.rank} is not a shard's")
