"""The library of failure patterns that worker logs are scanned against, each one classified.

A pattern names a failure type, a severity, and whether it is a hardware signature: a line that
means the node itself is bad (evict it) rather than the job or a peer (the types in
transom.common.anomaly_types.HARDWARE). Because a hardware classification evicts a node, every
pattern is anchored on the exact text a real component prints (the NVIDIA kernel driver, the
CUDA runtime, DCGM, nvidia-smi, the mlx5 driver, NCCL, PyTorch), case-sensitive as that text is:
a user's print that merely contains "error", "ECC", "Xid" or "fallen" is never a hardware error.
ECC counters themselves are read from NVML (transom.monitor.collect), not from free text.
tests/data/log_corpus holds the benign and hardware corpora these patterns are measured on.

This module only classifies lines; it never decides what to do about them (that is
transom.control.policy) and never reads files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from transom.common import anomaly_types

# -- NVIDIA's Xid catalogue ---------------------------------------------------------------------
# Source: NVIDIA's "Xid Errors" catalogue (docs.nvidia.com/deploy/xid-errors, the catalogue sheet's
# "immediate resolution" column). An Xid is a hardware fault of the node when the catalogue's
# answer is to reset the GPU or reboot the machine, or when it names failing memory, NVLink, the
# bus, power or the GPU's firmware: memory 48 (double-bit ECC), 63 (row remapping recorded, the
# GPU needs a reset to use it), 64 (remapping failed), 92 (high single-bit rate), 94 and 95
# (contained and uncontained memory errors), 140 (unrecovered ECC); bus, board and firmware 46,
# 54, 62, 79 (fallen off the bus), 109, 119 and 120 (GSP), 143, 158; links 74, 121, 136, 144-150,
# 155 (NVLink, C2C).
HARDWARE_XIDS = frozenset(
    {46, 48, 54, 62, 63, 64, 74, 79, 92, 94, 95, 109, 119, 120, 121, 136, 140, 143, 155, 158}
    | set(range(144, 151))
)
# Xids the catalogue answers with "restart the application" and whose investigation is the
# application's (out-of-range accesses, MMU faults, a channel the application's fault reset):
# 13 (graphics engine exception), 31 (GPU memory page fault), 43 (GPU stopped processing: the
# application's channel was reset), 45 (preemptive cleanup after another error), and the push
# buffer and class errors 11, 25, 32, 69, 80. A warning, never an eviction.
APPLICATION_XIDS = frozenset({11, 13, 25, 31, 32, 43, 45, 69, 80})
# Any other Xid (driver, video engines, informational) is a warning of type XID_OTHER.

_PCI = r"(?:PCI:)?(?:[0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?"
# The kernel driver: "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off
# the bus." (older drivers print the bus id without "PCI:").
_NVRM_XID = re.compile(r"\bNVRM: Xid \(" + _PCI + r"\): (\d{1,3}),")
# DCGM's health and diagnostic message DCGM_FR_XID_ERROR: "Detected XID 79 for GPU 0".
_DCGM_XID = re.compile(r"\bDetected XID (\d{1,3}) for GPU \d+\b")


def xid_type(xid: int) -> str:
    """The anomaly type of an Xid number (see the catalogue above)."""
    if xid in HARDWARE_XIDS:
        return anomaly_types.XID
    if xid in APPLICATION_XIDS:
        return anomaly_types.XID_APP
    return anomaly_types.XID_OTHER


@dataclass(frozen=True)
class Pattern:
    type: str
    severity: str  # "info" | "warning" | "critical"
    hardware: bool  # a signature of a bad node: evict it
    regex: re.Pattern
    source: str  # the component whose real output the regex is anchored on


@dataclass(frozen=True)
class Classification:
    """What one line was classified as: the fields a detector needs, and the Xid if it had one."""

    type: str
    severity: str
    hardware: bool
    pattern: Pattern
    xid: int | None = None


def _p(type_: str, severity: str, source: str, *alternatives: str) -> Pattern:
    regex = re.compile("|".join(f"(?:{a})" for a in alternatives))
    return Pattern(type_, severity, type_ in anomaly_types.HARDWARE, regex, source)


XID_PATTERN = Pattern(
    anomaly_types.XID,
    "critical",
    True,
    re.compile(f"{_NVRM_XID.pattern}|{_DCGM_XID.pattern}"),
    "NVIDIA kernel driver (NVRM) and DCGM's DCGM_FR_XID_ERROR",
)

# First match wins, so the specific patterns come before the generic ones; Xids come first.
PATTERNS: list[Pattern] = [
    XID_PATTERN,
    _p(
        anomaly_types.GPU_LOST,
        "critical",
        "NVIDIA kernel driver, nvidia-smi, NVML",
        r"\bNVRM: GPU (?:at )?" + _PCI + r": GPU has fallen off the bus\b",
        # The two-line form: "NVRM: The NVIDIA GPU 0000:18:00.0 (PCI ID: 10de:2901) installed in
        # this system has" / "NVRM: fallen off the bus and is not responding to commands."
        r"\bNVRM: fallen off the bus and is not responding to commands\b",
        r"\bUnable to determine the device handle for GPU ?"
        + _PCI
        + r": (?:GPU is lost|Unknown Error)",
        r"\bNVMLError_GpuIsLost\b",
    ),
    _p(
        anomaly_types.ECC,
        "critical",
        "CUDA runtime and driver error names, DCGM health messages (dcgm_errors.h)",
        r"\buncorrectable ECC error encountered\b",  # cudaGetErrorString(cudaErrorECCUncorrectable)
        r"\b(?:cudaErrorECCUncorrectable|CUDA_ERROR_ECC_UNCORRECTABLE)\b",
        r"\bDetected \d+ volatile double-bit ECC error\(s\) in GPU \d+\.",
        r"\bGPU \d+ had uncorrectable memory errors and (?:row remapping failed|\d+ rows were)",
        r"\bGPU had an uncontained error \(XID 95\)",
        r"\bPending page retirements together with a DBE were detected on GPU \d+\.",
        r"\bCUDA APIs have indicated that a double-bit ECC error has occured on GPU \d+\.",
    ),
    _p(
        anomaly_types.IB_ERROR,
        "critical",
        "the mlx5_core kernel driver (health poller, PCI errors and power, port module, link)",
        r"\bmlx5_core " + _PCI + r": (?:poll_health:\d+:\(pid \d+\): )?[Ff]atal error(?: \d+)? "
        r"detected\b",
        r"\bmlx5_core " + _PCI + r": .*device's health compromised\b",
        r"\bmlx5_core " + _PCI + r": (?:mlx5_pci_err_detected|mlx5_enter_error_state|"
        r"mlx5_handle_bad_state)\b",
        r"\bmlx5_core " + _PCI + r": Port module event\[error\]: module \d+, ",
        r"\bmlx5_core " + _PCI + r": mlx5_pcie_event:\d+:\(pid \d+\): Detected insufficient power "
        r"on the PCIe slot\b",
        r"\bmlx5_core " + _PCI + r" \S+: Link down\b",
    ),
    _p(
        "nccl_error",
        "warning",
        "NCCL's WARN lines and result codes, PyTorch's ProcessGroupNCCL",
        r"\bNCCL WARN\b",
        r"\bNCCL error in: \S+, ",
        r"\bnccl(?:SystemError|InternalError|UnhandledCudaError|RemoteError)\b",
        r"\bWatchdog caught collective operation timeout\b",
    ),
    _p(
        "cuda_error",
        "warning",
        "the CUDA runtime as PyTorch reports it, cuBLAS status names",
        r"\bCUDA error: [a-z]",
        r"\bCUBLAS_STATUS_(?!SUCCESS\b)[A-Z_]+\b",
        r"\bcudaErrorIllegalAddress\b",
        r"\bdevice-side assert triggered\b",
    ),
    _p(
        "oom",
        "warning",
        "PyTorch's allocators, the C library (ENOMEM)",
        r"\bCUDA out of memory\. Tried to allocate\b",
        r"\bOutOfMemoryError: ",
        r"\bCannot allocate memory\b",
        r"\bDefaultCPUAllocator: can't allocate memory\b",
    ),
    _p(
        "gloo_error",
        "info",
        "gloo as PyTorch reports it",
        r"\[enforce fail at \S*gloo/",
        r"\bGloo connectFullMesh failed\b",
        r"\bgloo/\S+\] .*(?:Timed out|[Tt]imeout)",
    ),
    _p(
        "traceback",
        "info",
        "the Python interpreter",
        r"^(?:\[rank\d+\]:\s*)?Traceback \(most recent call last\)",
    ),
]


def _xid_number(line: str) -> int:
    found = _NVRM_XID.search(line) or _DCGM_XID.search(line)
    assert found is not None  # XID_PATTERN matched, so one of its two alternatives did
    return int(found.group(1))


def classify(line: str) -> Classification | None:
    """What `line` is (the first pattern it matches, an Xid by its number), or None."""
    for pattern in PATTERNS:
        if not pattern.regex.search(line):
            continue
        if pattern is XID_PATTERN:
            xid = _xid_number(line)
            type_ = xid_type(xid)
            hardware = type_ in anomaly_types.HARDWARE
            severity = "critical" if hardware else "warning"
            return Classification(type_, severity, hardware, pattern, xid)
        return Classification(pattern.type, pattern.severity, pattern.hardware, pattern)
    return None
