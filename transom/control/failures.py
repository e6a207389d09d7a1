"""What a worker's exit means: its exit code or signal, and the error its log ends with.

A worker that dies because a *peer* died (the collective's connection was closed) is not the
root cause of an incident; `WorkerFailure.peer_error` tells the controller to look elsewhere.
That covers a worker that exits with such an error, and one that aborts (SIGABRT) on it.
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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
]
_PEER_ERROR = re.compile("|".join(PEER_ERROR_PATTERNS))
# The last "SomethingError: message" line of a Python traceback; once a process group exists,
# torch.distributed prefixes every traceback line with "[rankN]: ".
_EXCEPTION_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)\b.*)$", re.M
)


@dataclass
class WorkerFailure:
    """One worker's non-zero exit."""

    rank: int
    local_rank: int
    exitcode: int
    signal: str | None
    signature: str | None  # the exception line, e.g. "ValueError: bad shape"
    peer_error: bool
    time: float
    log: str

    def describe(self) -> str:
        how = f"killed by {self.signal}" if self.signal else f"exit code {self.exitcode}"
        detail = f": {self.signature}" if self.signature else ""
        return f"rank {self.rank} {how}{detail}"

    def to_dict(self) -> dict:
        return asdict(self)


def read_tail(path: Path, size: int = LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def classify_exit(rank: int, local_rank: int, exitcode: int, log_path: Path) -> WorkerFailure:
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
    return WorkerFailure(
        rank, local_rank, exitcode, sig, signature, peer, time.time(), str(log_path)
    )
