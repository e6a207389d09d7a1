"""The step report a framework callback makes: the framework's own step number, the loss, and
the step's timing as the zero-code optimizer hook measured it (transom.monitor.auto).

`attach()` (when training begins) turns the hook into the callback's timer: from then on it sends
no step of its own, so nothing is counted twice; `report_step` sends one step datagram with the
hook's dur, comm and compute (the callback's own duration where no hook is installed, e.g.
`--no-auto-monitor`; none for a step whose time held an evaluation, which is then left out of
the timing windows as the hook's own steps are: transom.monitor.eval_phase), and the loss.
Outside Transom (no agent) both do nothing. Neither may ever raise into training.
"""

from __future__ import annotations

import math
from typing import Any

from transom.monitor import auto, reporter


def attach() -> None:
    """Make the optimizer hook keep its timing for `report_step` instead of reporting steps."""
    try:
        steps = auto.counter()
        if steps is not None:
            steps.framework = True
    except Exception:  # noqa: BLE001 - monitoring must never break training
        pass


def mean_loss(losses: list[Any]) -> float | None:
    """The mean of loss tensors (or numbers) of one step; NaN if any is not finite."""
    try:
        values = [float(v.item() if hasattr(v, "item") else v) for v in losses]
    except (TypeError, ValueError, RuntimeError):
        return None
    if not values:
        return None
    if not all(math.isfinite(v) for v in values):
        return next(v for v in values if not math.isfinite(v))
    return sum(values) / len(values)


# The steps reported with a loss that was not finite, lately (`finite`).
_NOT_FINITE: list[int] = []


def finite(step: int) -> bool:
    """False when `step` was reported with a loss that was not finite (NaN/Inf) on this rank:
    a snapshot of it would hold the poisoned weights."""
    return step not in _NOT_FINITE


def report_step(step: int, loss: float | None, duration_s: float | None = None) -> None:
    """Report `step` (the framework's number) with its loss and timing."""
    if loss is not None and not math.isfinite(loss):
        _NOT_FINITE[:] = [*_NOT_FINITE[-7:], int(step)]
    try:
        steps = auto.counter()
        timing = steps.take_timing() if steps is not None and steps.framework else {}
        if timing is None:  # the step's time held an evaluation: no timing, not comparable
            timing = {}
        elif not timing and duration_s is not None and duration_s >= 0:
            timing = {"dur": duration_s}
        metrics: dict[str, float] = dict(timing)
        if loss is not None:
            metrics["loss"] = loss
        ch = reporter._get()
        if ch is not None:
            ch.faults.on_step(int(step))  # injected faults fire at the framework's steps
        reporter.report(int(step), **metrics)
    except Exception:  # noqa: BLE001 - monitoring must never break training
        pass
