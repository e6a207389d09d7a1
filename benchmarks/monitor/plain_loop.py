"""An unmodified training loop (no transom import) for `python -m benchmarks.monitor.overhead
--auto`: a small transformer language model on random tokens, AdamW, one process, CPU, a step
line a step ("step N loss X t=T", as examples/train_gpt.py writes it), so the zero-code
instrumentation's cost is measured on a loop that only the worker bootstrap instruments.

    python benchmarks/monitor/plain_loop.py --steps 300
"""

import argparse
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
args = p.parse_args()
torch.manual_seed(0)
vocab, width, context = 64, 64, 64
model = torch.nn.Sequential(
    torch.nn.Embedding(vocab, width),
    torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True), 2
    ),
    torch.nn.Linear(width, vocab),
)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
g = torch.Generator().manual_seed(0)
for step in range(args.steps):
    x = torch.randint(0, vocab, (12, context + 1), generator=g)
    logits = model(x[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f} t={time.time():.3f}", flush=True)
