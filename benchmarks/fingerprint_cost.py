"""Fingerprint cost: what hashing the parameters every N steps costs the demo model's step rate.

One rank trains the example GPT (`transom demo`'s model and batch, AdamW: the same trainer as
benchmarks/snapshots.py) in this process, on one thread. Each round trains a segment of --steps
steps without fingerprints (the baseline) and one segment for each interval of --every, in an
order that rotates each round so that a drift of the machine's load hits every arm alike. A
fingerprinted segment does what the worker's optimizer hook (transom/monitor/auto.py) adds to a
step: `fingerprint.due` every step and, when due, the digest of the optimizer's parameters, the
replica evidence kept of them (transom.monitor.evidence: a file in a temporary folder) and the
fingerprint datagram sent to a listening socket (a Unix datagram socket drained by a thread,
here in both arms). It reports, per interval:

  step_rate_x        steps/s fingerprinted / baseline of the same round, mean over the rounds
                     with its 95% bootstrap interval (stats.py); the issue's bar: a cost under
                     0.5%, so at least 0.995 (read the interval: on a shared machine the rounds
                     scatter by more than the effect)
  predicted_cost     the cost the clock says it must have: one fingerprint's median time over
                     (interval x the baseline's median step time)

and the two times (`fingerprint_ms`, `step_ms`, medians). The first WARMUP steps of each segment
are left out.

    python -m benchmarks.fingerprint_cost --json       # the table, then JSON on the last line
    python -m benchmarks.fingerprint_cost --device cuda --every 50 5 1

This module never changes what the hook does; it only calls the functions the hook calls.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks import stats
from benchmarks.demo_model import make_trainer
from transom.monitor import evidence, fingerprint

WARMUP = 10
TARGET_RATE_X = 0.995
FINGERPRINT_CALLS = 200  # for the median time of one fingerprint


def parameters(optimizer) -> list:
    """The parameters the hook hashes: the optimizer's, in its order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


class Listener:
    """A Unix datagram socket pair whose receiving end a thread drains (the agent's side)."""

    def __init__(self) -> None:
        self.send_end, self.recv_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.received = 0
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while True:
            try:
                if not self.recv_end.recv(65536):
                    return
            except OSError:
                return
            self.received += 1

    def send(self, step: int, digest: str) -> None:
        message = {"k": "fingerprint", "rank": 0, "gen": 1, "t": time.time(), "step": step}
        self.send_end.send(json.dumps({**message, "fp": digest}).encode())

    def close(self) -> None:
        self.send_end.close()
        self.thread.join(timeout=5)
        self.recv_end.close()


def segment(
    steps: int, first: int, train, optimizer, every: int, listener: Listener, folder: Path
) -> dict:
    """Train `steps` steps from step `first`, fingerprinting every `every` steps (0: never),
    the evidence kept in `folder`."""
    params = parameters(optimizer)
    times: list[float] = []
    for n in range(first, first + steps):
        t0 = time.perf_counter()
        train(n)
        if fingerprint.due(n, every, first=n == first):
            listener.send(n, fingerprinted(params, n, folder))
        times.append(time.perf_counter() - t0)
    kept = times[WARMUP:]
    return {"steps_per_s": len(kept) / sum(kept), "step_s": statistics.median(kept)}


def fingerprinted(params: list, step: int, folder: Path) -> str:
    """What the hook does at a due step: the digest, and the evidence kept in `folder`."""
    tensors = fingerprint.on_host(params)
    evidence.record(folder, 0, "fingerprint-cost", step, tensors)
    return fingerprint.digest(tensors)


def fingerprint_time(optimizer, folder: Path, calls: int = FINGERPRINT_CALLS) -> float:
    """Median seconds of one fingerprint of the optimizer's parameters."""
    params = parameters(optimizer)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fingerprinted(params, 0, folder)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(rounds: int, steps: int, intervals: list[int], device: str) -> dict:
    torch.set_num_threads(1)
    _, optimizer, train = make_trainer(device)
    listener = Listener()
    folder = Path(tempfile.mkdtemp(prefix="transom-fingerprint-cost-"))
    arms = [0, *intervals]
    rows = []
    step = 1
    try:
        train(0)  # the optimizer's state exists before the first fingerprint
        for i in range(rounds):
            order = arms[i % len(arms) :] + arms[: i % len(arms)]
            row = {}
            for every in order:
                row[str(every)] = segment(steps, step, train, optimizer, every, listener, folder)
                step += steps
            rows.append(row)
            rates = ", ".join(f"{e or 'never'}: {row[str(e)]['steps_per_s']:.2f}" for e in arms)
            print(f"round {i + 1}/{rounds}: steps/s {rates}", file=sys.stderr)
        one = fingerprint_time(optimizer, folder)
    finally:
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)
    step_s = statistics.median(r["0"]["step_s"] for r in rows)
    result: dict = {
        "device": device,
        "rounds": rounds,
        "steps": steps,
        "parameters": sum(p.numel() for p in parameters(optimizer)),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in parameters(optimizer)),
        "fingerprint_ms": one * 1e3,
        "step_ms": step_s * 1e3,
        "default_every": fingerprint.DEFAULT_EVERY,
        "intervals": {},
        "rows": rows,
    }
    for every in intervals:
        ratios = [r[str(every)]["steps_per_s"] / r["0"]["steps_per_s"] for r in rows]
        low, high = stats.interval(ratios)
        result["intervals"][str(every)] = {
            "step_rate_x": statistics.fmean(ratios),
            "step_rate_x_ci95": [low, high],
            "verdict": stats.verdict(low, high, TARGET_RATE_X, at_least=True),
            "predicted_cost": one / (every * step_s),
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fingerprint_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=10, help="rounds of all arms (10)")
    parser.add_argument("--steps", type=int, default=150, help="steps a segment (150)")
    parser.add_argument(
        "--every",
        type=int,
        nargs="+",
        default=[fingerprint.DEFAULT_EVERY, 5, 1],
        help=f"fingerprint intervals to measure ({fingerprint.DEFAULT_EVERY}, the default; 5, the "
        "demo's; 1, every step)",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--json", action="store_true", help="print the result as JSON last")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps <= WARMUP or any(e < 1 for e in args.every):
        parser.error(f"--rounds and --every must be positive, --steps above {WARMUP}")
    result = run(args.rounds, args.steps, args.every, args.device)
    print(
        f"{result['device']}: {result['parameters']} parameters; one fingerprint "
        f"{result['fingerprint_ms']:.3f} ms, a step {result['step_ms']:.2f} ms (medians)"
    )
    print(f"{'every':>6} {'step rate x':>12} {'95% interval':>20} {'predicted cost':>15}  verdict")
    for every, r in result["intervals"].items():
        low, high = r["step_rate_x_ci95"]
        print(
            f"{every:>6} {r['step_rate_x']:>12.4f} {f'{low:.4f} to {high:.4f}':>20} "
            f"{r['predicted_cost']:>14.4%}  {r['verdict']} at >= {TARGET_RATE_X}"
        )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
