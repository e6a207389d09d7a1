"""Sizes as people write them: '8G', '512MiB', '1.5g', '1000000' -> bytes.

One parser for every option that takes a size (the job's --ckpt-memory, the checkpoint
server's --memory). This module must never do I/O.
"""

from __future__ import annotations

UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes for `text`; ValueError with a one-line reason otherwise."""
    t = str(text).strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in UNITS and t[-1:] else ""
    number = t[:-1] if unit else t
    try:
        value = int(float(number) * UNITS[unit])
    except ValueError as e:
        raise ValueError(f"{text!r} is not a size (examples: 8G, 512M, 1073741824)") from e
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return value
