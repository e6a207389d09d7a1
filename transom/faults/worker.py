"""The worker's side of fault injection: the hooks the monitor API (transom.monitor) calls.

The agent hands each worker its faults in the FAULTS environment variable (JSON). The monitor
calls `on_step(step)` when a step begins and `on_loss(step, loss)` when the worker passes its
loss; each due fault of that hook fires once, changes the worker's `state` (slow) or the value
(nan), and is announced through `announce` (a datagram to the agent, which records it). A fault
with a "once_file" path fires only if this process can create that file (O_EXCL), so it fires
once even when a launcher other than Transom restarts the worker with the same environment.
This module must never inject anything that was not handed to it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from transom.common.record_base import RecordError
from transom.faults.fault_type import ON_LOSS, ON_STEP, WORKER, WorkerState
from transom.faults.registry import FAULT_TYPES
from transom.faults.schedule import read_fault


def parse_worker_faults(text: str | None, rank: int) -> list[dict]:
    """The faults in a FAULTS value aimed at `rank` (or at any rank); bad entries are dropped."""
    try:
        items = json.loads(text or "[]")
    except ValueError:
        return []
    out = []
    for item in items if isinstance(items, list) else []:
        try:
            fault = read_fault(item)
        except RecordError:
            continue
        if FAULT_TYPES[fault.type].where == WORKER and fault.rank in (None, rank):
            out.append(item)
    return out


def _claim(once_file: Any) -> bool:
    """True if a fault may fire: it has no once_file, or this call created it."""
    if once_file is None:
        return True
    try:
        os.close(os.open(str(once_file), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except OSError:
        return False  # fired before (or the folder is gone): never fire twice


class WorkerFaults:
    """This rank's pending faults and what the fired ones changed."""

    def __init__(self, faults: list[dict], announce: Callable[[dict, int], None]) -> None:
        self.pending = list(faults)
        self.announce = announce
        self.state = WorkerState()

    def _fire(self, step: int, hook: str, value: Any) -> Any:
        if not self.pending:
            return value
        due = [
            f
            for f in self.pending
            if FAULT_TYPES[f["type"]].worker_hook == hook and step >= int(f.get("step", 0))
        ]
        for f in due:
            self.pending.remove(f)
        for f in due:
            if _claim(f.get("once_file")):
                self.announce(f, step)
                value = FAULT_TYPES[f["type"]].fire_worker(read_fault(f), self.state, value)
        return value

    def on_step(self, step: int) -> None:
        """A step begins: fire the due ON_STEP faults (slow)."""
        self._fire(step, ON_STEP, None)

    def on_loss(self, step: int, loss: Any) -> Any:
        """The worker's loss of `step`, changed by the due ON_LOSS faults (nan)."""
        return self._fire(step, ON_LOSS, loss)
