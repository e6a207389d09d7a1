"""`Fault`: one scheduled fault to inject, as the job spec and a worker's FAULTS value carry it.

The schedule (`--faults`, transom.faults.schedule) is resolved once, into these records, when
the spec is built; the spec carries them through etcd to every node (`JobSpec.faults`), and an
agent hands its workers theirs in the FAULTS environment variable, so each copy crossed a process
boundary and is read back with `Fault.from_dict`, which checks every field's type. Which fault
types exist is transom.faults.registry's to say: a reader checks `type` there. This module must
never do I/O or import another transom package but `common`.
"""

from __future__ import annotations

from dataclasses import dataclass

from transom.common.record_base import Record

DEFAULT_LOG_LINE = (
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, GPU has fallen off the bus. [transom injected fault]"
)
DEFAULT_FACTOR = 2.0


@dataclass
class Fault(Record):
    """One scheduled fault: its type, the step that triggers it, and its target."""

    id: str
    type: str
    step: int = 0  # ignored by the types that fire when their place is reached (pre-flight)
    rank: int | None = None
    node: str | None = None
    factor: float = DEFAULT_FACTOR
    line: str = DEFAULT_LOG_LINE
    period: float | None = None  # seconds, for a duty cycle (throttle); None: the type's own
