"""The monitor's cost inside one training process: blocks of steps with it on and off, alternating.

Separate runs of a process differ by more than the monitor costs (where the allocator puts the
model, which core the scheduler picks: single runs of the same job vary by +-20% here), so pairs
of runs need very many pairs to show a 1% effect. Here one process trains train_gpt's model
(transom.workloads.gpt_model, its default size, one rank) and switches the monitor on and off
every BLOCK_STEPS steps in ABBA order (on-off, off-on, ...): an "on" step is wrapped exactly as
train_gpt wraps it (`monitor.step`, its `sync` section, `report`), sending to the live node
monitor the parent listens with (transom.monitor.node.NodeMonitor, in another process as the
agent's is); an "off" step makes no monitor call. The overhead is the mean step time of the "on"
blocks over that of the "off" blocks, less 1 (each block timed with perf_counter), with a 95%
bootstrap interval over the pairs. A ratio of means, not a mean of each pair's ratio: with short
blocks a pair's ratio is noisy, and the mean of a noisy ratio is biased upwards (by about the
square of the step time's coefficient of variation; `overhead_pair_mean_x` shows it). It leaves
out: the worker's sender thread (a heartbeat twice a second, a look for steps waiting ten times)
runs in both halves, and start-up (opening the channel) in neither; the run pairs of
overhead.py include both. The sender thread sends an "on" block's steps while it runs;
those still waiting when it ends are sent before its time is taken, so none cost an "off" block
(with blocks of one step most are sent by the main thread then: blocks of 20+ steps are fair to
the thread).

    python -m benchmarks.monitor.blocks --pairs 250 --block-steps 25
    python -m benchmarks.monitor.blocks --json      # last line: JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks import child_env, stats
from transom.common import env as env_names  # noqa: E402
from transom.monitor import reporter  # noqa: E402

BLOCK_STEPS = 25
PAIRS = 250
WARMUP_STEPS = 20  # steps before the first block (allocator, caches)


def train_blocks(pairs: int, block_steps: int, batch_s: float) -> None:
    """The child: train, switching the monitor on and off by block; one JSON line per block."""
    import torch

    from transom.workloads.gpt_model import GPT, get_batch, make_corpus, make_optimizer

    reporter.BATCH_S = batch_s
    if batch_s == 0:  # every step goes at once
        reporter.SLOW_STEP_S = 0.0
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
        channel = reporter._channel
        if on and channel is not None:
            channel.flush()  # this block's steps are sent in its own time, not the next block's
        seconds = (time.perf_counter() - t0) / block_steps
        print(json.dumps({"on": on, "step_s": seconds}), flush=True)


def measure(pairs: int, block_steps: int, batch_s: float) -> dict:
    """Run the child against a live node monitor; the overhead of its on/off block pairs."""
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
                "-m",
                "benchmarks.monitor.blocks",
                "--child",
                "--pairs",
                str(pairs),
                "--block-steps",
                str(block_steps),
                "--batch-s",
                str(batch_s),
            ],
            env=child_env(env),
            capture_output=True,
            text=True,
            timeout=3600,
            check=True,
        ).stdout
        accepted = monitor.counters()["accepted"]
    finally:
        monitor.close()
    blocks = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    pairs_s = [
        (a["step_s"], b["step_s"]) if a["on"] else (b["step_s"], a["step_s"])
        for a, b in zip(blocks[::2], blocks[1::2], strict=True)
    ]
    low, high = stats.interval(pairs_s, ratio_of_means)
    return {
        "pairs": pairs,
        "block_steps": block_steps,
        "batch_s": batch_s,
        "step_on_s": statistics.median(b["step_s"] for b in blocks if b["on"]),
        "step_off_s": statistics.median(b["step_s"] for b in blocks if not b["on"]),
        "overhead_x": ratio_of_means(pairs_s),
        "overhead_pair_mean_x": statistics.fmean(on / off - 1.0 for on, off in pairs_s),
        "overhead_ci95_x": [low, high],
        "datagrams_accepted": accepted,
    }


def ratio_of_means(pairs_s: list[tuple[float, float]]) -> float:
    """sum(on) / sum(off) - 1 over (on, off) pairs of seconds."""
    return sum(on for on, _ in pairs_s) / sum(off for _, off in pairs_s) - 1.0


def describe(o: dict) -> str:
    low, high = o["overhead_ci95_x"]
    return (
        f"monitoring overhead in one process: {o['overhead_x'] * 100:+.2f}% (95% CI "
        f"{low * 100:+.2f}% to {high * 100:+.2f}%, {o['pairs']} on/off pairs of blocks of "
        f"{o['block_steps']} steps, steps batched for {o['batch_s']} s; step "
        f"{o['step_on_s'] * 1000:.2f} ms on vs {o['step_off_s'] * 1000:.2f} ms off, medians)"
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
    p.add_argument(
        "--batch-s",
        type=float,
        default=reporter.BATCH_S,
        help="the worker's step batching period, reporter.BATCH_S (default %(default)s; 0: "
        "every step goes at once)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        train_blocks(args.pairs, args.block_steps, args.batch_s)
        return 0
    from benchmarks.monitor.overhead import print_result

    result = measure(args.pairs, args.block_steps, args.batch_s)
    print_result(describe(result), result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
