"""Fault types of the pre-flight check a node runs when it joins: slow_preflight.

This module must never change anything but the compute benchmark's cost on the target node.
"""

from __future__ import annotations

from transom.faults.base import PREFLIGHT, PREFLIGHT_EXCLUSION, Fault, FaultType


class SlowPreflight(FaultType):
    """The node's compute benchmark costs FACTOR times as much (a node slow from the start)."""

    name = "slow_preflight"
    where = PREFLIGHT
    detected_by = (PREFLIGHT_EXCLUSION,)  # the controller compares pre-flight scores
    description = "a node joins with a compute benchmark FACTOR x slower than its peers"
    needs_step = False

    def note(self, fault: Fault) -> str:
        return f" (x{fault.factor})"

    def validate(self, fault: Fault) -> str | None:
        if fault.node is None:
            return "needs node=NODE"
        return None if fault.factor > 1.0 else "factor must be above 1"

    def preflight_slowdown(self, fault: Fault) -> float:
        return float(fault.factor)
