"""The demo's model in one process, for the benchmarks that time its steps (snapshots,
fingerprint_cost): train_gpt's defaults on one rank. It only builds and trains the model; it never
measures anything itself."""

from __future__ import annotations

from collections.abc import Callable

import torch


def make_trainer(
    device: str = "cpu", seed: int = 0, after_closure: Callable[[], None] | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[int], None]]:
    """The demo's model, its optimizer and a function that trains step n (on `device`; a CUDA
    step is synchronized, so its time is the device's, as a rank's all-reduce waits for it).
    With `after_closure`, the forward and backward run in a closure given to the optimizer step,
    as Lightning's automatic optimisation runs them, and `after_closure` is called at its end."""
    from transom.workloads.gpt_model import GPT, get_batch, make_corpus, make_optimizer

    text = make_corpus()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    torch.manual_seed(seed)
    model = GPT(len(chars), 64, 2, 4, 64).to(device)
    optimizer = make_optimizer(model, 3e-3, 0.1)

    def forward_backward(n: int) -> torch.Tensor:
        x, y = get_batch(data, n, 0, seed, 12, 64)
        _, loss = model(x.to(device), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if after_closure is not None:
            after_closure()
        return loss

    def step(n: int) -> None:
        if after_closure is None:
            forward_backward(n)
            optimizer.step()
        else:
            optimizer.step(lambda: forward_backward(n))
        if device != "cpu":
            torch.cuda.synchronize()

    return model, optimizer, step
