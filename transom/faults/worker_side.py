"""Fault types the worker applies to itself through the monitor API: slow, nan and corrupt.

This module must never change anything but the worker's own timing, loss or parameters.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from typing import Any

from transom.common import anomaly_types
from transom.common.fault_spec import Fault
from transom.faults.fault_type import ON_LOSS, ON_STEP, WORKER, FaultType, WorkerState


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


class Corrupt(FaultType):
    """After its step's optimizer step, FACTOR low mantissa bits of the rank's parameters flip:
    no NaN, no loss spike, only replicas that no longer agree (transom.monitor.replicas)."""

    name = "corrupt"
    where = WORKER
    worker_hook = ON_STEP
    detected_by = (anomaly_types.SDC,)
    description = "bits of one rank's parameters flip silently (no NaN, no error)"

    def note(self, fault: Fault) -> str:
        return f" ({int(fault.factor)} bits)"

    def validate(self, fault: Fault) -> str | None:
        return None if 1 <= fault.factor <= 64 else "factor (the bits to flip) must be 1-64"

    def fire_worker(self, fault: Fault, state: WorkerState, value: Any) -> Any:
        state.corrupt_bits += int(fault.factor)
        return value

    def describe(self, fault: Fault) -> str:
        return f"{int(fault.factor)} bits of one rank's parameters flip silently"


# Mantissa bits by dtype name: a flip in the lower half of them changes a value by a relative
# 2^-12 (float32) or less: no NaN, no infinity, no visible jump in the loss.
_MANTISSA = {"float32": 23, "float64": 52, "float16": 10, "bfloat16": 7}
_SAME_WIDTH_INT = {"float32": "int32", "float64": "int64", "float16": "int16", "bfloat16": "int16"}


def flip_bits(parameters: Iterable[Any], bits: int, seed: int) -> int:
    """Flip `bits` low mantissa bits of the floating parameters, in place; how many flipped."""
    import torch

    names = {getattr(torch, n): n for n in _MANTISSA}
    candidates = [p for p in parameters if p.dtype in names and p.numel() and p.is_contiguous()]
    rng = random.Random(seed)
    flipped = 0
    with torch.no_grad():
        for _ in range(bits if candidates else 0):
            p = rng.choice(candidates)
            name = names[p.dtype]
            word = p.data.view(-1).view(getattr(torch, _SAME_WIDTH_INT[name]))
            index = rng.randrange(word.numel())
            word[index] ^= 1 << rng.randrange(_MANTISSA[name] // 2)
            flipped += 1
    return flipped
