"""Fault types of the pre-flight check a node runs when it joins: slow_preflight, slow_link.

This module must never change anything but the cost of the target node's pre-flight compute
benchmark or link test (transom.control.preflight, transom.control.links).
"""

from __future__ import annotations

from transom.common.fault_spec import Fault
from transom.faults.fault_type import PREFLIGHT, PREFLIGHT_EXCLUSION, FaultType


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


class SlowLink(FaultType):
    """Each send of the node's pre-flight link test, its answers to peers included, waits FACTOR
    milliseconds first (a node joining with a bad network link)."""

    name = "slow_link"
    where = PREFLIGHT
    detected_by = (PREFLIGHT_EXCLUSION,)  # the controller compares the nodes' link scores
    description = "a node joins with a slow network link (each link-test send waits FACTOR ms)"
    needs_step = False

    def note(self, fault: Fault) -> str:
        return f" ({fault.factor:g} ms a send)"

    def validate(self, fault: Fault) -> str | None:
        if fault.node is None:
            return "needs node=NODE"
        return None if fault.factor > 0 else "factor (ms) must be above 0"

    def preflight_link_delay_s(self, fault: Fault) -> float:
        return float(fault.factor) / 1000.0
