"""Snapshot benchmark: what a checkpoint every step costs the example model's training.

One rank trains the example GPT (transom/workloads: `transom demo`'s model and batch, AdamW) in
this process, on a core of its own (the last one), while two checkpoint servers run as processes
on the other cores: "node0", its node's, which replicates every shard to "node1" and persists
every PERSIST_EVERY-th step to storage, as `transom run` workers do by default. In alternating
pairs (the order flips each pair) it trains --steps steps
  baseline    without checkpoints
  snapshots   saving every step (`Engine.save(..., overlap=True)`, memory and a peer's memory,
              storage every PERSIST_EVERY steps): the bytes are copied while the next step's
              forward and backward run, its optimizer step waits for the copy
and reports
  step_rate_x         steps/s with snapshots / without, mean over the pairs with its 95%
                      bootstrap interval (stats.py); the issue's bar: a cost under 2%, at least
                      0.98
  blocking_fraction   the save's blocking part (`SaveHandle.blocking_s`: planning the state,
                      reserving the region, handing the copy over) over the step's time, medians
                      over the snapshot segments; the bar: under 0.05
  blocking_ms, step_ms  those medians
  copy_wait_ms        median time the optimizer step waited for the copy (0 when it was done)
With --closure the forward and backward run in a closure given to the optimizer step, as
Lightning's automatic optimisation runs them (the copy's wait then comes when the closure
returns: overlap.py). The first WARMUP steps of each segment are left out. A step here is one
process's: a rank of a real job also waits for its peers, which makes the save's share smaller,
not larger.

    python -m benchmarks.snapshots --json        # the table, then JSON on the last line
    python -m benchmarks.snapshots --closure     # the optimizer step given a closure

This module starts two checkpoint servers and stops them; it never changes what a save does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import stats
from benchmarks.checkpoint import SECRET, start_server
from benchmarks.demo_model import make_trainer
from benchmarks.isolation import thread_ids

PERSIST_EVERY = 20
WARMUP = 10
TARGET_RATE_X = 0.98
TARGET_BLOCKING = 0.05


def segment(
    steps: int,
    first: int,
    train,
    engine=None,
    model=None,
    optimizer=None,
    waits: list[float] | None = None,
    persist_every: int = PERSIST_EVERY,
) -> dict:
    """Train `steps` steps from step `first`, saving each one when `engine` is given. `waits`:
    the copy's waits, timed by the closure's end (--closure); else timed by a pre-step hook."""
    hooked = waits is None
    waits = [] if waits is None else waits
    waits.clear()
    if engine is not None and hooked:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        hook = register_optimizer_step_pre_hook(
            lambda *_: waits.append(_timed(engine._copy.wait_copied))
        )
    blocking: list[float] = []
    times: list[float] = []
    try:
        for n in range(first, first + steps):
            t0 = time.perf_counter()
            train(n)
            if engine is not None:
                state = {"step": n, "model": model.state_dict(), "optim": optimizer.state_dict()}
                persist = persist_every > 0 and n % persist_every == 0
                handle = engine.save(n, state, persist=persist, overlap=True)
                blocking.append(handle.blocking_s)
            times.append(time.perf_counter() - t0)
    finally:
        if engine is not None and hooked:
            hook.remove()
    kept = times[WARMUP:]
    return {
        "steps_per_s": len(kept) / sum(kept),
        "step_s": statistics.median(kept),
        "blocking_s": statistics.median(blocking[WARMUP:]) if blocking else None,
        "copy_wait_s": statistics.median(waits[WARMUP:]) if engine is not None else None,
    }


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# What a save reaches (--tiers): the node's memory, a peer's memory, storage every PERSIST_EVERY.
TIERS = ("all", "peer", "memory")


def run(
    pairs: int, steps: int, closure: bool = False, tiers: str = "all", copy_on: str = "rank"
) -> dict:
    from transom import checkpoint
    from transom.utils.procs import stop_process

    cores = sorted(os.sched_getaffinity(0))
    rank_core, rest = cores[-1:], cores[:-1] or cores
    work = Path(tempfile.mkdtemp(prefix="snapshots-"))
    servers = []
    try:
        # The servers inherit the other cores, every thread of them (an affinity set on a
        # running process moves its main thread only: its other threads shared the rank's core).
        os.sched_setaffinity(0, rest)
        extra = ["--replicas", "0"]
        if tiers != "memory":
            peer, _, peer_addr = start_server(work, "node1", 1 << 30, ["--replicas", "0"])
            servers.append(peer)
            extra = ["--peer", peer_addr, "--storage", str(work / "storage")]
        own, sock, _ = start_server(work, "node0", 1 << 30, extra)
        servers.append(own)
        persist_every = PERSIST_EVERY if tiers == "all" else 0
        os.sched_setaffinity(0, rank_core)
        shared = [
            t
            for p in servers
            for t in thread_ids(p.pid)
            if os.sched_getaffinity(t) & set(rank_core)
        ]
        if shared:
            raise RuntimeError(f"server threads {shared} may run on the rank's core {rank_core}")
        torch.set_num_threads(1)
        engine = checkpoint.Engine(
            socket_path=sock, rank=0, world_size=1, secret=SECRET.encode(), storage_dir=work
        )
        waits: list[float] | None = [] if closure else None
        timed_wait = (lambda: waits.append(_timed(engine._copy.wait_copied))) if closure else None
        model, optimizer, train = make_trainer(after_closure=timed_wait)
        if copy_on == "rest":  # a rank of several cores: its copy thread on another than its loop
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            engine.save(0, state, persist=False, overlap=True)  # starts the copy thread
            engine._copy.wait_finished()
            thread = engine._copy._thread
            assert thread is not None and thread.native_id is not None
            os.sched_setaffinity(thread.native_id, rest)
        rows = []
        step = 1
        for i in range(pairs):
            pair = {}
            for kind in ("baseline", "snapshots") if i % 2 == 0 else ("snapshots", "baseline"):
                saving = engine if kind == "snapshots" else None
                pair[kind] = segment(
                    steps, step, train, saving, model, optimizer, waits, persist_every
                )
                step += steps
            rows.append(pair)
            print(
                f"pair {i + 1}/{pairs}: baseline {pair['baseline']['steps_per_s']:.2f} steps/s, "
                f"snapshots {pair['snapshots']['steps_per_s']:.2f} steps/s",
                file=sys.stderr,
            )
        engine.close()
    finally:
        for p in servers:
            stop_process(p)
        shutil.rmtree(work, ignore_errors=True)
    ratios = [r["snapshots"]["steps_per_s"] / r["baseline"]["steps_per_s"] for r in rows]
    low, high = stats.interval(ratios)
    snap = [r["snapshots"] for r in rows]
    step_s = statistics.median(s["step_s"] for s in snap)
    blocking_s = statistics.median(s["blocking_s"] for s in snap)
    fraction = blocking_s / step_s
    return {
        "pairs": pairs,
        "steps": steps,
        "closure": closure,
        "tiers": tiers,
        "copy_on": copy_on,
        "rank_core": rank_core,
        "server_cores": rest,
        "step_rate_x": statistics.fmean(ratios),
        "step_rate_x_ci95": [low, high],
        "step_rate_verdict": stats.verdict(low, high, TARGET_RATE_X, at_least=True),
        "blocking_fraction": fraction,
        "blocking_verdict": "met" if fraction < TARGET_BLOCKING else "missed",
        "blocking_ms": blocking_s * 1e3,
        "step_ms": step_s * 1e3,
        "baseline_step_ms": statistics.median(r["baseline"]["step_s"] for r in rows) * 1e3,
        "copy_wait_ms": statistics.median(s["copy_wait_s"] for s in snap) * 1e3,
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.snapshots",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pairs", type=int, default=6, help="alternating pairs (6)")
    parser.add_argument("--steps", type=int, default=200, help="steps a segment (200)")
    parser.add_argument(
        "--closure", action="store_true", help="forward and backward in the step's closure"
    )
    parser.add_argument(
        "--tiers",
        choices=TIERS,
        default="all",
        help="what a save reaches: all (memory, a peer's memory, storage every "
        f"{PERSIST_EVERY}th step; the default, as `transom run`), peer (no storage), memory "
        "(the node's server alone): which part of the pipeline costs the rank",
    )
    parser.add_argument(
        "--copy-on",
        choices=("rank", "rest"),
        default="rank",
        help="the core of the save's copy thread: rank (the rank's one core, the default) or "
        "rest (the servers' cores, as a rank of several cores would run it beside its loop)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON last")
    args = parser.parse_args()
    if args.pairs < 1 or args.steps <= WARMUP:
        parser.error(f"--pairs must be positive and --steps above {WARMUP}")
    result = run(args.pairs, args.steps, args.closure, args.tiers, args.copy_on)
    low, high = result["step_rate_x_ci95"]
    print(
        f"step_rate_x {result['step_rate_x']:.3f} ({low:.3f} to {high:.3f}: "
        f"{result['step_rate_verdict']} at >= {TARGET_RATE_X})\n"
        f"blocking {result['blocking_ms']:.2f} ms of a {result['step_ms']:.1f} ms step = "
        f"{result['blocking_fraction']:.3f} ({result['blocking_verdict']} at < {TARGET_BLOCKING})"
        f"\nbaseline step {result['baseline_step_ms']:.1f} ms; the optimizer step waited "
        f"{result['copy_wait_ms']:.2f} ms for the copy (median)"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
