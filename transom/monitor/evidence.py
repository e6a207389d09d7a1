"""Replica evidence: a rank's parameters at its fingerprint steps, kept on its node, so that the
replay of a step whose fingerprints split can say which replica had it wrong.

Why values and not digests: with 2 replicas a split has no majority, and the replay of the split
step from the last agreeing snapshot (transom.monitor.replicas) equals neither replica, since the
gradients' all-reduce carried the wrong replica's error into both replicas' updates. What the
all-reduce cannot do is move the corruption itself: both replicas apply the same averaged update,
so they still differ exactly where the wrong one's values were changed, and there the right one
is within rounding of the replay, the wrong one off by the corruption (measured on the demo's
GPT: 2 flipped low mantissa bits leave the wrong replica 1 to 1,000 rounding units off the replay
at those elements, the right one 0 to 4, while the replay differs from both by a few units at
thousands of other elements alike).

So at each fingerprint the worker instrumentation (transom.monitor.auto) keeps its parameters'
bytes in `TRANSOM_EVIDENCE_DIR` (its node's folder, `local{L}.step{S}.bin`, the newest KEPT
steps, parameters of at most MAX_BYTES). A later generation that fingerprints the same step (the
replay after a rollback) first compares its parameters with the file: `deviations`, the TOP
largest element-wise differences, each in rounding units of its tensor (eps x max(|value|, the
tensor's RMS)), with the element's index in the parameters' order; [] when they are equal. The
rank sends them with its fingerprint; the controller compares the replicas' lists: the elements
only one node's list shows, above what the other's list still holds, are that node's corruption.
A difference of about one rounding unit cannot be told apart from the replay's own rounding.

The file crossed a process boundary: one of another job, step or layout, or unreadable, gives no
comparison. This module must never change a parameter, and never raise into training (callers
catch).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transom.common import env

# Parameters larger than this are not kept: the copy is written in the training thread. Measured
# here (caches cold, as after a step): 0.4 MB (the demo's model) costs its step about 1 ms and
# the next few 0.1-0.3 ms each; 8 MiB 2.2 ms, 32 MiB 8 ms, 128 MiB 0.4 s (the kernel throttles
# the writer of that many dirty pages). At the default interval (at least 8 s between
# fingerprints) 32 MiB costs 0.1%. (A thread of its own to write the file saved nothing: what
# the step no longer paid the next ones did, in the GIL and the memory bandwidth.) A larger
# model's 2-replica splits name no node.
MAX_BYTES = 32 << 20
KEPT = 8  # fingerprint steps kept a rank: a split is decided a few fingerprints after its step
TOP = 32  # deviations a rank reports
HEADER_MAX = 1 << 20  # bytes of a file's JSON header line
MAX_ELEMENT = 1 << 53  # an element index that crossed a process boundary is below this
_NAME = re.compile(r"local(\d+)\.step(\d+)\.bin")

Deviations = list[tuple[int, float]]


def is_deviation(value: Any) -> bool:
    """Whether `value`, which crossed a process boundary (a datagram, a summary), is one
    [element index, rounding units] pair: an index in range, units positive and finite."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        return False
    index, units = value
    return (
        type(index) is int
        and 0 <= index < MAX_ELEMENT
        and type(units) in (int, float)
        and 0 < units < math.inf
    )


def directory() -> Path | None:
    """The node's evidence folder its agent names (None: evidence is off)."""
    value = os.environ.get(env.EVIDENCE_DIR)
    return Path(value) if value else None


def record(
    folder: Path, local_rank: int, job: str, step: int, tensors: Sequence[Any]
) -> Deviations | None:
    """Compare `tensors` (the rank's parameters on the host, in order) with what an earlier
    process of this job kept for `step`, then keep them for it: the deviations, or None when
    there was nothing to compare with."""
    import torch

    size = sum(t.numel() * t.element_size() for t in tensors)
    if size > MAX_BYTES:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"local{local_rank}.step{step}.bin"
    layout = [[str(t.dtype), list(t.shape)] for t in tensors]
    found = _compare(path, job, step, layout, tensors, size)
    header = json.dumps({"job": job, "step": step, "pid": os.getpid(), "layout": layout})
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    with open(partial, "wb") as f:
        f.write(header.encode() + b"\n")
        for t in tensors:
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
    os.replace(partial, path)
    _prune(folder, local_rank)
    return found


def deviations(old: Sequence[Any], new: Sequence[Any], top: int = TOP) -> Deviations:
    """The `top` largest element-wise differences of `old` from `new` (tensors of the same
    layouts), in rounding units of each `new` tensor: (index in the flat order, units), largest
    first; only elements that differ."""
    import torch

    found: Deviations = []
    offset = 0
    for before, now in zip(old, new, strict=True):
        n = now.numel()
        if now.is_floating_point() and n:
            a, b = before.reshape(-1).double(), now.reshape(-1).double()
            scale = torch.maximum(b.abs(), b.square().mean().sqrt()) * torch.finfo(now.dtype).eps
            units = (a - b).abs() / scale.clamp_min(torch.finfo(torch.float64).tiny)
            units = torch.where(a == b, torch.zeros_like(units), units)  # inf - inf, nan
            units = torch.nan_to_num(units, nan=0.0, posinf=1e300)
            values, where = units.topk(min(top, n))
            pairs = zip(where.tolist(), values.tolist(), strict=True)
            found += [(offset + i, v) for i, v in pairs if v > 0]
        elif n:
            differ = (before.reshape(-1) != now.reshape(-1)).nonzero().reshape(-1)[:top]
            found += [(offset + int(i), 1e300) for i in differ]
        offset += n
    found.sort(key=lambda d: -d[1])
    return [(i, float(f"{v:.6g}")) for i, v in found[:top]]


def _compare(
    path: Path, job: str, step: int, layout: list, tensors: Sequence[Any], size: int
) -> Deviations | None:
    """The deviations from the file at `path` if it is this job's, of `step` and `layout` (of
    `size` bytes), and was kept by another process; None otherwise."""
    import torch

    try:
        with open(path, "rb") as f:
            line = f.readline(HEADER_MAX)
            header = json.loads(line)
            if not isinstance(header, dict) or header.get("job") != job:
                return None
            if header.get("step") != step or header.get("layout") != layout:
                return None
            if header.get("pid") == os.getpid():
                return None  # this process's own: not a replay
            data = f.read()
    except (OSError, ValueError):
        return None
    if len(data) != size:
        return None
    old, offset = [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        raw = torch.frombuffer(bytearray(data[offset : offset + size]), dtype=torch.uint8)
        old.append(raw.view(t.dtype).reshape(t.shape))
        offset += size
    return deviations(old, tensors)


def _prune(folder: Path, local_rank: int) -> None:
    """Leave the newest KEPT steps' files of this local rank (and no temporary file that a
    killed process of it left)."""
    steps = []
    for entry in folder.iterdir():
        m = _NAME.fullmatch(entry.name)
        if m and int(m.group(1)) == local_rank:
            steps.append((int(m.group(2)), entry))
        elif entry.name.startswith(f".local{local_rank}.step"):
            entry.unlink(missing_ok=True)  # this process's own is renamed by now
    for _, entry in sorted(steps)[:-KEPT]:
        entry.unlink(missing_ok=True)
