"""Replica fingerprints: a rank's parameters hashed every few steps, to catch silent corruption.

In data-parallel training every replica holds the same parameters after each step, bit for bit
(that is also why Transom's weights are bit-identical after a recovery). A rank whose parameters
differ from its replicas' computed, stored or received something wrong without an error: a
silent data corruption, which a NaN rule misses nearly always. Every `every()` steps (and at a
generation's first step) the worker instrumentation (transom.monitor.auto) hashes the parameters
its optimizer steps, in their fixed order, with xxh3 over their bytes, and sends the hex digest
with the step's number; the controller compares the ranks' digests of the same step
(transom.monitor.replicas).

TRANSOM_FINGERPRINT_EVERY sets the interval in steps (0 turns it off). Unset, it is
DEFAULT_EVERY, doubled (100, 200, ... up to MAX_EVERY) while that many of the rank's steps take
less than MIN_PERIOD_S (`interval`): each fingerprint is an etcd write of its node's summary, and
a job of 30 ms steps would otherwise write one every 1.5 s a node (issue 44: at most one request
a node a second in all). The intervals are nested, so ranks whose step times straddle a doubling
still fingerprint common steps (those of the coarser interval), which the controller compares.
A parameter on a GPU is copied to the host to be hashed, which waits for the device: its cost is
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
# The default interval's fingerprints come at least this far apart (two summary keep-alives:
# transom.monitor.detectors.SUMMARY_KEEPALIVE_S), within MAX_EVERY steps.
MIN_PERIOD_S = 8.0
MAX_EVERY = DEFAULT_EVERY << 6  # 3,200 steps
MAX_DIGEST = 32  # characters of a digest that crossed a process boundary


def configured() -> int | None:
    """The interval in steps TRANSOM_FINGERPRINT_EVERY sets (0: off); None when it is unset or
    not a number (the default: `interval`)."""
    try:
        return max(0, int(os.environ[env.FINGERPRINT_EVERY]))
    except (KeyError, ValueError):
        return None


def interval(configured_every: int | None, step_s: float | None) -> int:
    """The interval in steps: `configured_every` where set, else DEFAULT_EVERY doubled while that
    many steps of `step_s` (the rank's typical step time; None: not known yet) take less than
    MIN_PERIOD_S, at most MAX_EVERY."""
    if configured_every is not None:
        return configured_every
    every = DEFAULT_EVERY
    while step_s is not None and every * step_s < MIN_PERIOD_S and every < MAX_EVERY:
        every *= 2
    return every


def due(step: int, interval: int, first: bool) -> bool:
    """Whether step `step` is fingerprinted: the generation's first step, then every
    `interval` steps (numbered as the optimizer counts them, so every replica picks the same)."""
    return interval > 0 and (first or step % interval == 0)


def of_parameters(parameters: Iterable[Any]) -> str:
    """The xxh3-64 hex digest of the parameters' bytes, in order."""
    return digest(on_host(parameters))


def on_host(parameters: Iterable[Any]) -> list[Any]:
    """The parameters' values as contiguous host tensors, in order (a device's are copied)."""
    out = []
    for p in parameters:
        t = p.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        out.append(t.contiguous())
    return out


def digest(tensors: Iterable[Any]) -> str:
    """The xxh3-64 hex digest of contiguous host tensors' bytes, in order."""
    import torch

    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(t.reshape(-1).view(dtype=torch.uint8).numpy())
    return h.hexdigest()
