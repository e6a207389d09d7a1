"""A DDP script (no transom imports) whose ranks print harmless lines that look like errors.

Every step each rank prints the next slice of a corpus of benign lines (default: the whole of
tests/data/log_corpus/benign.txt over the run: "0 ECC errors", "xid 42 column", NCCL INFO lines,
progress bars, warnings) and a loss line of its own with "ECC", "Xid" and "fallen" in it, so the
monitor's log scanner reads every benign line from real worker logs while training goes on.
"""

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

CORPUS = Path(__file__).resolve().parent.parent / "data" / "log_corpus" / "benign.txt"

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--step-delay", type=float, default=0.1)
parser.add_argument("--corpus", default=str(CORPUS))
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
lines = Path(args.corpus).read_text().splitlines()
per_step = math.ceil(len(lines) / args.steps)
weight = torch.zeros(4)
print(f"noisy rank={rank} world_size={world} pid={os.getpid()}", flush=True)
for step in range(1, args.steps + 1):
    grad = torch.full((4,), float(rank + step))
    dist.all_reduce(grad)
    weight -= 0.01 * grad / world
    for line in lines[(step - 1) * per_step : step * per_step]:
        print(line)
    print(
        f"step {step} loss {weight.abs().sum().item():.4f}: 0 ECC errors, Xid {step}, "
        "nothing has fallen, no timeout",
        flush=True,
    )
    time.sleep(args.step_delay)
dist.barrier()
print(f"done rank={rank} printed={len(lines)}", flush=True)
dist.destroy_process_group()
