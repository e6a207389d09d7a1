"""Hugging Face `Trainer` in one line: `Trainer(..., callbacks=[TransomCallback()])`.

The callback reports each optimizer step to the node agent with the Trainer's own step number
(`state.global_step`, which a resumed Trainer continues) and that step's training loss, so the
agent's numerics detector finds a NaN/Inf or a spiking loss at its step and the controller rolls
back (transom.control.policy), while the zero-code hooks (transom.monitor.auto) still time the
step and its wait in collectives. The loss is taken from the model's own output (a forward hook:
`outputs.loss` in training mode, averaged over gradient-accumulation micro-batches), so no
`logging_steps=1` is needed; reading it costs one `.item()` a micro-batch.

What it must never do: change the Trainer's control flow or raise into training (every hook
swallows its errors; without Transom it does nothing but its bookkeeping).
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

from transom.integrations import steps


class TransomCallback(TrainerCallback):
    """Reports the Trainer's steps and losses to Transom's monitor."""

    def __init__(self) -> None:
        self._losses: list[Any] = []
        self._handle: Any = None
        self._began: float | None = None

    def _capture(self, module: Any, inputs: Any, output: Any) -> None:
        try:
            if not module.training:
                return  # an evaluation's forward: not a training step's loss
            loss = output.get("loss") if hasattr(output, "get") else None
            if loss is None:
                loss = getattr(output, "loss", None)
            if loss is not None and hasattr(loss, "detach"):
                self._losses.append(loss.detach())
        except Exception:  # noqa: BLE001
            pass

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        steps.attach()
        model = kwargs.get("model")
        if self._handle is None and model is not None:
            try:
                self._handle = model.register_forward_hook(self._capture)
            except Exception:  # noqa: BLE001
                self._handle = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._began is None:
            self._began = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        duration = now - self._began if self._began is not None else None
        self._began = now  # the next step begins as this one ends (data loading included)
        losses, self._losses = self._losses, []
        steps.report_step(state.global_step, steps.mean_loss(losses), duration)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
