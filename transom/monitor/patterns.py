"""The library of failure patterns that worker logs are scanned against, each one classified.

A pattern names a failure type, a severity, and whether it is a hardware signature: a line
that means the node itself is bad (evict it) rather than the job or a peer (the types in
transom.common.anomalies.HARDWARE). This module only
classifies lines; it never decides what to do about them (that is transom.control.policy).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from transom.common import anomalies


@dataclass(frozen=True)
class Pattern:
    type: str
    severity: str  # "info" | "warning" | "critical"
    hardware: bool  # a signature of a bad node: evict it
    regex: re.Pattern


def _p(type_: str, severity: str, regex: str) -> Pattern:
    return Pattern(type_, severity, type_ in anomalies.HARDWARE, re.compile(regex, re.I))


# First match wins, so the specific patterns come before the generic ones.
PATTERNS: list[Pattern] = [
    _p(anomalies.XID, "critical", r"\bNVRM: Xid\b|\bXid \(PCI:|\bXid\s+\d+\b"),
    _p(
        anomalies.GPU_LOST,
        "critical",
        r"GPU has fallen off the bus|Unable to determine the device handle",
    ),
    _p(
        anomalies.ECC,
        "critical",
        r"uncorrectable ECC|ECC error|DBE \(double bit error\)|row remap(ping)? fail",
    ),
    _p(
        anomalies.IB_ERROR,
        "critical",
        r"\bmlx5_\w+\b.*\b(error|fatal)|IB(V|verbs)? .*(port|link) (down|error)",
    ),
    _p(
        "nccl_error",
        "warning",
        r"NCCL (WARN|error)|ncclSystemError|ncclInternalError|"
        r"ncclUnhandledCudaError|ProcessGroupNCCL.*(timeout|Watchdog)",
    ),
    _p(
        "cuda_error",
        "warning",
        r"CUDA error|CUBLAS_STATUS_\w+|cudaErrorIllegalAddress|"
        r"device-side assert",
    ),
    _p(
        "oom",
        "warning",
        r"CUDA out of memory|OutOfMemoryError|Cannot allocate memory|"
        r"DefaultCPUAllocator: can't allocate",
    ),
    _p(
        "gloo_error",
        "info",
        r"\[gloo/|Gloo connectFullMesh failed|gloo.*(Timed out|timeout)",
    ),
    _p("traceback", "info", r"^(\[rank\d+\]:\s*)?Traceback \(most recent call last\)"),
]


def classify(line: str) -> Pattern | None:
    """The first pattern `line` matches, or None."""
    for pattern in PATTERNS:
        if pattern.regex.search(line):
            return pattern
    return None
