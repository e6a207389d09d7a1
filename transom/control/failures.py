"""What a worker's exit means: its exit code or signal, and the error its log ends with.

A worker that dies because a *peer* died (the collective's connection was closed) is not the
root cause of an incident; `FailureReport.peer_error` (transom.common.records) tells the
controller to look elsewhere. That covers a worker that exits with such an error, and one that
aborts (SIGABRT) on it. This module only reads a worker's log; it never signals or reports.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

from transom.checkpoint.client import PEER_COPIES_BAD
from transom.common.records import FailureKind, FailureReport

LOG_TAIL_BYTES = 16384

# Messages a worker prints when a collective broke because another rank went away.
PEER_ERROR_PATTERNS = [
    r"Connection closed by peer",
    r"Connection reset by peer",
    r"Broken pipe",
    r"ECONNRESET",
    r"Connection refused",
    r"Socket Timeout",
    r"Timed out waiting",
    r"DistNetworkError",
    r"DistBackendError",
    r"Read error",
    r"Sending data failed",
    # this rank's copies were good, another's were not (checkpoint/agreement.py)
    re.escape(PEER_COPIES_BAD),
]
_PEER_ERROR = re.compile("|".join(PEER_ERROR_PATTERNS))
# The last "SomethingError: message" line of a Python traceback; once a process group exists,
# torch.distributed prefixes every traceback line with "[rankN]: ".
_EXCEPTION_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)\b.*)$", re.M
)


def read_tail(path: Path, size: int = LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def classify_exit(rank: int, local_rank: int, exitcode: int, log_path: Path) -> FailureReport:
    """Describe a worker that exited with `exitcode` (negative: killed by that signal)."""
    sig = None
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode).name
        except ValueError:
            sig = f"signal {-exitcode}"
    tail = read_tail(log_path)
    lines = _EXCEPTION_LINE.findall(tail)
    signature = lines[-1].strip()[:300] if lines else None
    # An exit after a broken collective; gloo sometimes aborts (SIGABRT) on the same error.
    peer = (sig is None and bool(_PEER_ERROR.search(tail))) or (
        sig == "SIGABRT" and bool(signature and _PEER_ERROR.search(signature))
    )
    how = f"killed by {sig}" if sig else f"exit code {exitcode}"
    detail = f": {signature}" if signature else ""
    return FailureReport(
        FailureKind.WORKER,
        f"rank {rank} {how}{detail}",
        time.time(),
        peer,
        rank,
        local_rank,
        exitcode,
        sig,
        signature,
        str(log_path),
    )
