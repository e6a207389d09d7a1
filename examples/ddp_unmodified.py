"""A plain torchrun-style DDP training script: no Transom import, nothing Transom-specific.

It is what a user brings: `torch.distributed` over gloo (CPU), a DistributedDataParallel MLP
learning a fixed random function of synthetic inputs, AdamW, and a checkpoint of its own
(torch.save on rank 0 every --ckpt-every steps) that it resumes from. Run it like any script:

    torchrun --nproc-per-node 2 examples/ddp_unmodified.py --steps 100
    transom run --nnodes 2 examples/ddp_unmodified.py --steps 100

Under `transom run` the worker bootstrap instruments it without a change (docs/integrations.md):
steps from the optimizer, the wait in DDP's gradient all-reduce, a heartbeat, so hangs and
stragglers are found in it. The detection benchmark measures that
(`python -m benchmarks.detection --script ddp`).

A step is a few tens of milliseconds on one CPU thread (--width 512, --batch 64). --data-delay S
makes each batch take S seconds more to arrive, as a data pipeline would. Rank 0 prints
`step N loss L t=TIME` after each step (time.time(); N from 1, the optimizer's own count).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--width", type=int, default=512)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--data-delay", type=float, default=0.0)
parser.add_argument("--ckpt-every", type=int, default=10)
parser.add_argument("--ckpt-dir", default=os.environ.get("TRANSOM_CHECKPOINT_DIR", "checkpoints"))
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
torch.manual_seed(args.seed)
IN = 64
net = torch.nn.Sequential(
    torch.nn.Linear(IN, args.width),
    torch.nn.GELU(),
    torch.nn.Linear(args.width, args.width),
    torch.nn.GELU(),
    torch.nn.Linear(args.width, 1),
)
teacher = torch.randn(IN, 1) / IN**0.5  # the function to learn: sin of a fixed projection
model = DDP(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
path = os.path.join(args.ckpt_dir, "ddp_unmodified.pt")
start = 0
if os.path.exists(path):
    state = torch.load(path, weights_only=True)
    net.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    start = state["step"]
print(f"rank {rank} of {world}: resumed at step {start}", flush=True)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch for this rank: a function of (seed, step, rank) alone."""
    time.sleep(args.data_delay)
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(args.batch, IN, generator=g)
    return x, torch.sin(3 * x @ teacher)


for step in range(start + 1, args.steps + 1):
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f} t={time.time():.3f}", flush=True)
        if step % args.ckpt_every == 0 or step == args.steps:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step}
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
dist.barrier()
print(f"rank {rank}: done at step {args.steps}", flush=True)
dist.destroy_process_group()
