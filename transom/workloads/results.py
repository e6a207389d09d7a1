"""The example workload's result files: what each rank of train_gpt.py reports, as JSON.

With `--result-dir DIR` every rank keeps DIR/rankR.json up to date (written whole, then renamed):
    {"rank": R, "world_size": W, "resumed_step": S, "step": N, "loss": L, "done": bool, "time": T}
at start (resumed_step, step = S), every --log-every steps, and at the end (done). The demo reads
these instead of parsing log lines. This module imports only the standard library (the demo
reads results without importing torch) and must never write anything but these files.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

PREFIX = "rank"
SUFFIX = ".json"


def result_path(result_dir: str | os.PathLike, rank: int) -> Path:
    return Path(result_dir) / f"{PREFIX}{rank}{SUFFIX}"


def write_result(result_dir: str | os.PathLike, rank: int, **record) -> None:
    """Replace rank's result file with `record` (plus rank and time), atomically."""
    path = result_path(result_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"rank": rank, "time": time.time(), **record}))
    os.replace(tmp, path)


def read_results(result_dir: str | os.PathLike) -> dict[int, dict]:
    """Rank -> its latest result record; unreadable or partial files are left out."""
    out: dict[int, dict] = {}
    for path in Path(result_dir).glob(f"{PREFIX}*{SUFFIX}"):
        try:
            record = json.loads(path.read_text())
            out[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
