"""The zero-code monitor's step numbers: an optimizer's own count (transom.monitor.auto)."""

from __future__ import annotations

import torch

from transom.monitor.auto import optimizer_step


def test_step_numbers_are_the_optimizers_own_count_and_go_on_after_a_resume():
    model = torch.nn.Linear(2, 1)
    adam = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        adam.step()
    assert optimizer_step(adam) == 2  # the third step, numbered from 0
    resumed = torch.optim.AdamW(model.parameters())
    resumed.load_state_dict(adam.state_dict())  # as a script resuming from its checkpoint
    model(torch.ones(1, 2)).sum().backward()
    resumed.step()
    assert optimizer_step(resumed) == 3
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # keeps no count: the hook counts
    sgd.step()
    assert optimizer_step(sgd) is None
    assert dict(sgd.state) == {}  # only read: no empty state entry left behind
    first = next(iter(adam.state))
    for forged in (torch.tensor(float("nan")), torch.ones(2), "x"):
        adam.state[first]["step"] = forged
        assert optimizer_step(adam) is None
