"""Fault types the worker applies to itself through the monitor API: slow and nan.

This module must never change anything but the worker's own timing or loss.
"""

from __future__ import annotations

import math
from typing import Any

from transom.common import anomaly_types
from transom.common.fault_spec import Fault
from transom.faults.base import ON_LOSS, ON_STEP, WORKER, FaultType, WorkerState


class Slow(FaultType):
    """From its step on, the rank computes FACTOR times as long (the monitor stretches it)."""

    name = "slow"
    where = WORKER
    worker_hook = ON_STEP
    detected_by = (anomaly_types.STRAGGLER,)
    description = "a node computes FACTOR x slower"
    in_random = True

    def note(self, fault: Fault) -> str:
        return f" (x{fault.factor})"

    def validate(self, fault: Fault) -> str | None:
        return None if fault.factor > 1.0 else "factor must be above 1"

    def fire_worker(self, fault: Fault, state: WorkerState, value: Any) -> Any:
        state.slow_factor = max(state.slow_factor, float(fault.factor))
        return value

    def describe(self, fault: Fault) -> str:
        return f"a node computes {fault.factor:g}x slower"


class Nan(FaultType):
    """The rank's loss is multiplied by NaN before backward, once."""

    name = "nan"
    where = WORKER
    worker_hook = ON_LOSS
    detected_by = (anomaly_types.NAN,)
    description = "the loss of one rank turns NaN"
    in_random = True

    def fire_worker(self, fault: Fault, state: WorkerState, value: Any) -> Any:
        return value * math.nan
