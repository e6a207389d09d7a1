"""An unmodified script's evaluations, seen without its help: a phase from the trained model's
`eval()` to its `train()`.

A framework's evaluation loop (the Hugging Face Trainer's `evaluate`, Lightning's validation
loop) and a plain script's alike switch the model to eval mode, run forward passes and
collectives for as long as the validation set takes, and switch it back, with no optimizer step
in between. Unmarked, such a pass is a long step: the hang rule takes an evaluation longer than
max(--hang-floor, 4 steps) for a hang (no rank finished a step, every rank alive and in a
collective) and restarts the job, and then again at the same step, which fails it; and its
run-queue waits count as stopped time (transom.monitor.stopped_time). So the worker bootstrap
(transom.monitor.auto) patches `torch.nn.Module.train`, which `eval()` calls: switching the
trained model to eval mode enters the EVAL_PHASE phase (transom.monitor.reporter), in which the
controller waits detectors.PHASE_HANG_S before it calls a hang, and switching it back, or the
next optimizer step, leaves it; that step is marked as in a phase, out of the timing windows
(a step a framework callback reports goes without its timing: transom.integrations.steps).

The trained model is a module with a parameter the stepping optimizer steps, or before the first
step any module with parameters (an evaluation before training is a phase too). A frozen module
put in eval mode (a teacher, a reference model) has none the optimizer steps: no phase; and one
begun before training ends at the first optimizer step (training goes on).

It must never raise into, or change, what the script's `train()` and `eval()` do: it looks
after the call, on the main thread, at the outermost call only (`train()` recurses into every
submodule, each call through the patch).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from transom.monitor import reporter

EVAL_PHASE = "eval"


class EvalPhase:
    """Whether the trained model is in eval mode now, and whether it was since the last step."""

    def __init__(self, stepped: Callable[[], Any]) -> None:
        self.stepped = stepped  # the optimizer whose steps are counted (None before the first)
        self.on = False
        self.seen = False  # the phase was on since the last optimizer step
        self.previous: str | None = None  # the phase it interrupted
        self.depth = 0  # train() calls in progress on the main thread

    def switched(self, module: Any, mode: bool) -> None:
        """`module.train(mode)` returned (the outermost call)."""
        if mode:
            self.end()
        elif not self.on and self.trained(module):
            self.previous = reporter.enter_phase(EVAL_PHASE)
            self.on = self.seen = True

    def end(self) -> None:
        """Leave the phase, if on (the model back in train mode, or an optimizer step)."""
        if self.on:
            self.on = False
            reporter.leave_phase(self.previous, EVAL_PHASE)

    def take_seen(self) -> bool:
        """Whether the phase was on since the last call (an optimizer step's: it ends it)."""
        self.end()
        seen, self.seen = self.seen, False
        return seen

    def trained(self, module: Any) -> bool:
        """Whether `module` has a parameter the stepping optimizer steps (before the first
        step: any parameter)."""
        optimizer = self.stepped()
        if optimizer is None:
            return any(True for _ in module.parameters())
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return any(id(p) in ids for p in module.parameters())


def install(tracker: EvalPhase) -> None:
    """Patch `torch.nn.Module.train` to tell `tracker` of each outermost switch."""
    import torch

    original = torch.nn.Module.train
    if getattr(original, "_transom_eval_phase", False):
        return

    @functools.wraps(original)
    def train(self: Any, mode: bool = True) -> Any:
        if tracker.depth or threading.current_thread() is not threading.main_thread():
            return original(self, mode)
        tracker.depth += 1
        try:
            result = original(self, mode)
        finally:
            tracker.depth -= 1
        try:
            tracker.switched(self, bool(mode))
        except Exception:  # noqa: BLE001 - monitoring must never break training
            pass
        return result

    train._transom_eval_phase = True  # type: ignore[attr-defined]
    torch.nn.Module.train = train  # type: ignore[method-assign]
