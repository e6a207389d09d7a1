"""The monitor's cost inside one training process: blocks of steps with it on and off, alternating.

Separate runs of a process differ by more than the monitor costs (where the allocator puts the
model, which core the scheduler picks: single runs of the same job vary by +-20% here), so pairs
of runs need very many pairs to show a 1% effect. Here one process trains train_gpt's model
(transom.workloads.gpt_model, its default size, one rank) and switches the monitor on and off
every BLOCK_STEPS steps in ABBA order (on-off, off-on, ...): an "on" step is wrapped exactly as
train_gpt wraps it (`monitor.step`, its `sync` section, `report`), sending to the live node
monitor the parent listens with (transom.monitor.node.NodeMonitor, in another process as the
agent's is); an "off" step makes no monitor call. The overhead of a pair is on/off - 1, from
each block's mean step time (perf_counter); the result is their mean with a 95% bootstrap
interval. What it leaves out: the worker's heartbeat thread (one datagram a second) runs in both
halves, and start-up (opening the channel) in neither; the run pairs of monitor_overhead.py
include both.

    python benchmarks/monitor_blocks.py --pairs 200 --block-steps 40
    python benchmarks/monitor_blocks.py --json      # last line: JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from transom.common import env as env_names  # noqa: E402

BLOCK_STEPS = 40
PAIRS = 200
WARMUP_STEPS = 20  # steps before the first block (allocator, caches)
TARGET = 0.01


def train_blocks(pairs: int, block_steps: int) -> None:
    """The child: train, switching the monitor on and off by block; one JSON line per block."""
    import torch

    from transom.monitor import reporter
    from transom.workloads.gpt_model import GPT, get_batch, make_corpus, make_optimizer

    torch.set_num_threads(1)
    text = make_corpus()
    stoi = {c: i for i, c in enumerate(sorted(set(text)))}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    torch.manual_seed(0)
    model = GPT(len(stoi), 64, 2, 4, 64)
    optimizer = make_optimizer(model, 3e-3, 0.1)

    def plain(step: int) -> float:
        x, y = get_batch(data, step, 0, 0, 12, 64)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item()

    def monitored(step: int) -> None:
        with reporter.step(step) as s:
            x, y = get_batch(data, step, 0, 0, 12, 64)
            _, loss = model(x, y)
            loss = s.inject(loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            with s.section("sync"):
                pass
            optimizer.step()
            s.report(loss=loss.item(), tokens=12 * 64)

    step = 0
    for _ in range(WARMUP_STEPS):
        step += 1
        monitored(step)
    for i in range(2 * pairs):
        on = (i % 2 == 0) == (i // 2 % 2 == 0)  # ABBA: on, off, off, on, on, off, ...
        t0 = time.perf_counter()
        for _ in range(block_steps):
            step += 1
            if on:
                monitored(step)
            else:
                plain(step)
        seconds = (time.perf_counter() - t0) / block_steps
        print(json.dumps({"on": on, "step_s": seconds}), flush=True)


def measure(pairs: int, block_steps: int) -> dict:
    """Run the child against a live node monitor; the overhead of its on/off block pairs."""
    from monitor_overhead import confidence_interval

    from transom.monitor.node import NodeMonitor

    monitor = NodeMonitor("overhead-blocks")
    monitor.expect_ranks([0])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSOM_", "RANK"))}
    env.update({"OMP_NUM_THREADS": "1", "RANK": "0"})
    env[env_names.MONITOR_SOCKET] = str(monitor.socket_path)
    try:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                "--pairs",
                str(pairs),
                "--block-steps",
                str(block_steps),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
            check=True,
        ).stdout
        accepted = monitor.counters()["accepted"]
    finally:
        monitor.close()
    blocks = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    ratios = []
    for a, b in zip(blocks[::2], blocks[1::2], strict=True):
        on, off = (a, b) if a["on"] else (b, a)
        ratios.append(on["step_s"] / off["step_s"] - 1.0)
    low, high = confidence_interval(ratios)
    return {
        "pairs": pairs,
        "block_steps": block_steps,
        "step_on_s": statistics.median(b["step_s"] for b in blocks if b["on"]),
        "step_off_s": statistics.median(b["step_s"] for b in blocks if not b["on"]),
        "overhead_x": statistics.fmean(ratios),
        "overhead_ci95_x": [low, high],
        "datagrams_accepted": accepted,
    }


def describe(o: dict) -> str:
    low, high = o["overhead_ci95_x"]
    return (
        f"monitoring overhead in one process: {o['overhead_x'] * 100:+.2f}% (95% CI "
        f"{low * 100:+.2f}% to {high * 100:+.2f}%, {o['pairs']} on/off pairs of blocks of "
        f"{o['block_steps']} steps; step {o['step_on_s'] * 1000:.2f} ms on vs "
        f"{o['step_off_s'] * 1000:.2f} ms off, medians)"
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--pairs", type=int, default=PAIRS, help=f"on/off pairs (default {PAIRS})")
    p.add_argument(
        "--block-steps",
        type=int,
        default=BLOCK_STEPS,
        help=f"steps a block (default {BLOCK_STEPS})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        train_blocks(args.pairs, args.block_steps)
        return 0
    result = measure(args.pairs, args.block_steps)
    print(describe(result))
    verdict = "below" if result["overhead_ci95_x"][1] < TARGET else "not shown below"
    print(f"target: {verdict} {TARGET * 100:.0f}% (the interval's upper end)")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
