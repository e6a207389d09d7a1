"""Replica fingerprints: a rank's parameters hashed every few steps, to catch silent corruption.

In data-parallel training every replica holds the same parameters after each step, bit for bit
(that is also why Transom's weights are bit-identical after a recovery). A rank whose parameters
differ from its replicas' computed, stored or received something wrong without an error: a
silent data corruption, which a NaN rule misses nearly always. Every `every()` steps (and at a
generation's first step) the worker instrumentation (transom.monitor.auto) hashes the parameters
its optimizer steps, in their fixed order, with xxh3 over their bytes, and sends the hex digest
with the step's number; the controller compares the ranks' digests of the same step
(transom.monitor.replicas).

TRANSOM_FINGERPRINT_EVERY sets the interval in steps (DEFAULT_EVERY; 0 turns it off). A
parameter on a GPU is copied to the host to be hashed, which waits for the device: its cost is
measured in benchmarks, and the interval keeps it small.

This module must never change a parameter, and never raise into training (callers catch).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import xxhash

from transom.common import env

DEFAULT_EVERY = 50
MAX_DIGEST = 32  # characters of a digest that crossed a process boundary


def every() -> int:
    """The interval in steps from the environment (DEFAULT_EVERY when unset or not a number;
    0: off)."""
    try:
        value = int(os.environ.get(env.FINGERPRINT_EVERY, DEFAULT_EVERY))
    except ValueError:
        return DEFAULT_EVERY
    return max(0, value)


def due(step: int, interval: int, first: bool) -> bool:
    """Whether step `step` is fingerprinted: the generation's first step, then every
    `interval` steps (numbered as the optimizer counts them, so every replica picks the same)."""
    return interval > 0 and (first or step % interval == 0)


def of_parameters(parameters: Iterable[Any]) -> str:
    """The xxh3-64 hex digest of the parameters' bytes, in order."""
    import torch

    digest = xxhash.xxh3_64()
    for p in parameters:
        t = p.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        digest.update(t.contiguous().reshape(-1).view(dtype=torch.uint8).numpy())
    return digest.hexdigest()
