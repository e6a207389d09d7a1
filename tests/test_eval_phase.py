"""An unmodified script's evaluation seen from its model's eval() and train()
(transom.monitor.eval_phase), in this process: which module's switch counts, the outermost call
only, the next optimizer step ending it, and the script's own train()/eval() unchanged. (With an
agent, end to end: tests/test_auto_monitor.py.)"""

from __future__ import annotations

import pytest
import torch

from transom.monitor import eval_phase


class Stepping:
    """The optimizer the tracker is told steps (None before the first step)."""

    def __init__(self) -> None:
        self.optimizer: torch.optim.Optimizer | None = None

    def __call__(self) -> torch.optim.Optimizer | None:
        return self.optimizer


@pytest.fixture
def tracked(monkeypatch):
    """A tracker with torch.nn.Module.train patched for it (unpatched after the test)."""
    monkeypatch.setattr(torch.nn.Module, "train", torch.nn.Module.train)
    stepping = Stepping()
    tracker = eval_phase.EvalPhase(stepping)
    eval_phase.install(tracker)
    return tracker, stepping


def test_the_trained_models_eval_to_train_is_the_phase(tracked):
    tracker, stepping = tracked
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    stepping.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert model.eval() is model and not model.training  # what eval() does is unchanged
    assert not model[0].training and tracker.on and tracker.depth == 0
    model.train()
    assert model[2].training and not tracker.on
    assert tracker.take_seen() and not tracker.take_seen()  # seen since the last step, once
    model[0].eval()  # a submodule of the trained model counts alone too
    assert tracker.on


def test_a_frozen_module_in_eval_mode_is_no_evaluation(tracked):
    tracker, stepping = tracked
    student, teacher = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    stepping.optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    teacher.eval()
    assert not tracker.on and not tracker.take_seen()
    with pytest.raises(ValueError):  # torch's own check, through the patch
        teacher.train("yes")  # type: ignore[arg-type]


def test_before_the_first_step_any_module_counts_and_the_step_ends_it(tracked):
    tracker, stepping = tracked
    teacher, student = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    teacher.eval()  # set up before training: taken for an evaluation, for now
    assert tracker.on
    torch.nn.ReLU().eval()  # no parameters: nothing to evaluate
    stepping.optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    assert tracker.take_seen() and not tracker.on  # the first step: training goes on
    teacher.eval()
    assert not tracker.on
