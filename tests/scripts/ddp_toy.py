"""An unmodified torchrun-style DDP script (no transom imports): a linear model, a few steps.

Prints its world and resumes from a torch.save checkpoint in --ckpt-dir, so restarts are
visible. --step-delay makes steps slow enough for a test to kill something mid-run;
--slow-rank R --slow-s S makes rank R compute S seconds longer each step (the others wait for
it); --sync allreduce averages the gradients with torch.distributed.all_reduce instead of DDP;
--save-s S makes rank 0's torch.save of each step take S seconds longer (a slow file system),
--save-s-at STEP only that step's; --eval-every N --eval-s S evaluates after every N-th step
for S seconds (the model in eval mode, a forward pass and an all_reduce of its loss every 50 ms,
no optimizer step), as a framework's evaluation loop does; --busy-every N --busy-s S makes
rank 0 work S seconds outside a step after every N-th step while the others wait at a barrier:
--busy-in main generates samples from the model in Python (not in eval mode), --busy-in child
waits for a DataLoader's worker process that prepares one slow batch (an epoch's start);
--wait-forever-at STEP makes rank 0 wait forever after that step while the others wait at a
barrier, in a blocking call (--wait-how sleep), a spin inside one long call (spin: a large
matrix product, its stack still while it runs) or a polling loop (poll): a hang, whatever its
shape.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--step-delay", type=float, default=0.0)
parser.add_argument("--slow-rank", type=int, default=-1)
parser.add_argument("--slow-s", type=float, default=0.0)
parser.add_argument("--sync", choices=("ddp", "allreduce"), default="ddp")
parser.add_argument("--save-s", type=float, default=0.0)
parser.add_argument("--save-s-at", type=int, default=None)
parser.add_argument("--eval-every", type=int, default=0)
parser.add_argument("--eval-s", type=float, default=0.0)
parser.add_argument("--busy-every", type=int, default=0)
parser.add_argument("--busy-s", type=float, default=0.0)
parser.add_argument("--busy-in", choices=("main", "child"), default="main")
parser.add_argument("--wait-forever-at", type=int, default=0)
parser.add_argument("--wait-how", choices=("sleep", "spin", "poll"), default="sleep")
parser.add_argument("--ckpt-dir", default=os.environ.get("TRANSOM_CHECKPOINT_DIR", "checkpoints"))
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
print(
    f"world rank={rank} world_size={world} local_rank={os.environ['LOCAL_RANK']} "
    f"group_rank={os.environ['GROUP_RANK']} restart={os.environ['TORCHELASTIC_RESTART_COUNT']}",
    flush=True,
)
torch.manual_seed(0)
net = torch.nn.Linear(8, 1)
model = DDP(net) if args.sync == "ddp" else net
opt = torch.optim.SGD(model.parameters(), lr=0.01)
path = os.path.join(args.ckpt_dir, "toy.pt")
start = 0
if os.path.exists(path):
    state = torch.load(path, weights_only=True)
    net.load_state_dict(state["model"])
    start = state["step"]
print(f"resumed step={start} rank={rank}", flush=True)


class SlowBatch(torch.utils.data.Dataset):
    """One batch that takes `seconds` of CPU to prepare, as an epoch's first batches can."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __len__(self):
        return 1

    def __getitem__(self, i):
        until, n = time.monotonic() + self.seconds, 0
        while time.monotonic() < until:
            n = (n * 31 + 7) % 1000003
        return torch.full((8,), float(n % 7))


def work_outside_a_step(seconds):
    """Rank 0's work after a step, which nothing marks: samples or a slow first batch."""
    if args.busy_in == "child":
        loader = torch.utils.data.DataLoader(SlowBatch(seconds), num_workers=1)
        return sum(float(b.sum()) for b in loader)
    until, text = time.monotonic() + seconds, []
    with torch.no_grad():
        while time.monotonic() < until:
            out = net(torch.randn(4, 8))
            text.append(" ".join(f"{v:.3f}" for v in out.flatten().tolist()))
    return len(text)


def wait_forever():
    """Rank 0 waits for something that never comes, in the shape --wait-how names."""
    print(f"waiting forever t={time.time():.3f}", flush=True)
    if args.wait_how == "sleep":
        time.sleep(10**6)
    elif args.wait_how == "spin":  # one long call into C that runs, as a GPU sync spins
        a = torch.ones(8000, 8000)
        while True:
            a @ a  # noqa: B018 - seconds a call, on one line: one stack
    else:
        while not os.path.exists(os.path.join(args.ckpt_dir, "never")):
            time.sleep(0.01)


class SlowFile:
    """A file whose first write waits `delay` seconds (a slow file system)."""

    def __init__(self, f, delay):
        self.f, self.delay = f, delay

    def write(self, b):
        if self.delay:
            time.sleep(self.delay)
            self.delay = 0.0
        return self.f.write(b)

    def flush(self):
        self.f.flush()


for step in range(start + 1, args.steps + 1):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 100 + rank))
    if rank == args.slow_rank:
        time.sleep(args.slow_s)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if args.sync == "allreduce":
        for p in net.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    opt.step()
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        slow = args.save_s if args.save_s_at in (None, step) else 0.0
        with open(path + ".tmp", "wb") as f:
            torch.save({"model": net.state_dict(), "step": step}, SlowFile(f, slow))
        os.replace(path + ".tmp", path)
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    if args.eval_every and step % args.eval_every == 0:
        model.eval()
        until, val = time.monotonic() + args.eval_s, torch.zeros(())
        with torch.no_grad():
            while True:  # every rank runs as many batches as rank 0 says
                go = torch.tensor([float(time.monotonic() < until)])
                dist.broadcast(go, 0)
                if not go.item():
                    break
                val = model(torch.randn(16, 8)).pow(2).mean()
                dist.all_reduce(val)
                time.sleep(0.05)
        if rank == 0:
            print(f"eval step {step} loss {val.item() / world:.4f}", flush=True)
        model.train()
    if step == args.wait_forever_at:
        if rank == 0:
            wait_forever()
        dist.barrier()
    if args.busy_every and step % args.busy_every == 0:
        if rank == 0:
            print(f"busy after step {step}: {work_outside_a_step(args.busy_s)}", flush=True)
        dist.barrier()
    time.sleep(args.step_delay)
dist.barrier()
print(f"done rank={rank}", flush=True)
dist.destroy_process_group()
