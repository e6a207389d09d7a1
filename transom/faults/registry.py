"""The fault types, by name, and the table of what detects each one.

Adding a fault type: one new class (a file of its own, or next to its kind in agent_side.py,
worker_side.py, preflight_side.py) and one line in FAULT_TYPES below. The report
(transom.report.analysis), the demo and the detection benchmark read DETECTORS; the schedule
parser, the injector and the worker hook read FAULT_TYPES. This module must never fire faults.
"""

from __future__ import annotations

from transom.faults.agent_side import Crash, Hang, Kill, LogLine
from transom.faults.cpu_quota import CpuQuota
from transom.faults.fault_type import AGENT, PREFLIGHT, WORKER, FaultType
from transom.faults.preflight_side import SlowLink, SlowPreflight
from transom.faults.throttle import Throttle
from transom.faults.worker_side import Corrupt, Nan, Slow

# The order matters: `random` schedules draw from the in_random types in this order.
FAULT_TYPES: dict[str, FaultType] = {
    t.name: t
    for t in (
        Crash(),
        Hang(),
        Slow(),
        Nan(),
        LogLine(),
        Kill(),
        SlowPreflight(),
        SlowLink(),
        Throttle(),
        CpuQuota(),
        Corrupt(),
    )
}

# Fault type -> the anomaly types that detect it (kill: NODE_LOST, found by the controller).
DETECTORS: dict[str, tuple[str, ...]] = {name: t.detected_by for name, t in FAULT_TYPES.items()}


def names_where(where: str) -> tuple[str, ...]:
    """The fault types applied in `where` (AGENT, WORKER or PREFLIGHT)."""
    return tuple(name for name, t in FAULT_TYPES.items() if t.where == where)


AGENT_FAULTS = names_where(AGENT)
WORKER_FAULTS = names_where(WORKER)
PREFLIGHT_FAULTS = names_where(PREFLIGHT)
RANDOM_TYPES = tuple(name for name, t in FAULT_TYPES.items() if t.in_random)
