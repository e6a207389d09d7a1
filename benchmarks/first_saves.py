"""First saves benchmark: do a rank's first checkpoint saves block only for a memory copy?

A steady save is a copy into a region the worker has mapped before; a rank's first saves rotate
through new regions (memory keeps its newest steps and a spare), and a region created or mapped
inside a save costs far more than the copy (issue 42: "the 1st, 2nd and 3rd saves of a 1 GiB
state each block <= 1.2x the copy floor"). This runs one rank with an in-process checkpoint
server (`checkpoint.Engine()` outside a launcher), prepares its regions (`Engine.prepare`: one for
each save of the rotation, the steps memory keeps and the save in progress), saves the same state
`--saves` times `--gap` seconds apart, and prints each save's blocking time against the copy
floor: a copy of the state into a buffer already written once, timed just before that save (the
engine up, its regions made, after the same gap). The floor before the engine starts (the median
of 7) is reported too: on this VM it moves by 1.5x from run to run, and by up to 1.4x once the
engine's regions (3 GiB more in use) are made, so only a floor timed beside each save tells
the save's own cost.

    python -m benchmarks.first_saves                      # 1 GiB, 6 saves 2 s apart, 3 runs
    python -m benchmarks.first_saves --gib 0.25 --gap 0.5 --runs 5 --json

Run it alone: a loaded machine moves the floor and every save with it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from transom import checkpoint

TENSOR_ELEMENTS = 64 << 20  # 256 MiB of fp32 a tensor
TARGET_X = 1.2


def one_run(gib: float, saves: int, gap_s: float, persist: bool) -> dict:
    count = max(1, round(gib * 4))  # tensors of 256 MiB
    state = {f"t{i}": torch.randn(TENSOR_ELEMENTS) for i in range(count)}
    buffers = {k: torch.empty_like(v) for k, v in state.items()}
    floors = []
    for _ in range(8):  # the first copy writes the buffers' pages: not timed
        t0 = time.perf_counter()
        for k, v in state.items():
            buffers[k].copy_(v)
        floors.append(time.perf_counter() - t0)
    floor = statistics.median(floors[1:])
    blocked, floors_before = [], []
    with tempfile.TemporaryDirectory() as storage:
        engine = checkpoint.Engine(storage_dir=storage, rank=0, world_size=1)
        try:
            engine.prepare(state, persist=persist)
            for step in range(1, saves + 1):
                time.sleep(gap_s)
                t0 = time.perf_counter()
                for k, v in state.items():
                    buffers[k].copy_(v)
                floors_before.append(time.perf_counter() - t0)
                handle = engine.save(step, state, persist=persist)
                blocked.append(handle.blocking_s)
                handle.wait("memory", timeout=120)
        finally:
            engine.close(wait=False)
    # Against the run's own steady saves too (the 4th and later: regions reused, mapped): the
    # floor, a copy between anonymous buffers, moves by 2x from run to run on this VM.
    steady = statistics.median(blocked[3:]) if len(blocked) > 3 else None
    return {
        "floor_s": floor,
        "floors_before_s": floors_before,
        "blocked_s": blocked,
        "blocked_x": [b / f for b, f in zip(blocked, floors_before, strict=True)],
        "blocked_vs_first_floor_x": [b / floor for b in blocked],
        "steady_s": steady,
        "vs_steady_x": [b / steady for b in blocked] if steady else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.first_saves", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    parser.add_argument("--saves", type=int, default=6, help="saves a run (default 6)")
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between saves (default 2)")
    parser.add_argument("--runs", type=int, default=3, help="runs, each a new engine (default 3)")
    parser.add_argument("--persist", action="store_true", help="persist every save to storage")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        run = one_run(args.gib, args.saves, args.gap, args.persist)
        runs.append(run)
        shown = " ".join(f"{x:.1f}x" for x in run["blocked_x"])
        print(
            f"run {i + 1}: floor {run['floor_s']:.3f} s at the start, "
            f"{min(run['floors_before_s']):.3f}-{max(run['floors_before_s']):.3f} s before the "
            f"saves; save i blocked, against the floor before it: {shown}",
            flush=True,
        )
    worst = [max(r["blocked_x"][i] for r in runs) for i in range(args.saves)]
    first_three = worst[:3]
    print(
        f"slowest of {args.runs} runs, save by save: "
        + " ".join(f"{x:.2f}x" for x in worst)
        + f"; first three within {TARGET_X}x of the floor: {max(first_three) <= TARGET_X}"
    )
    against_steady = [r["vs_steady_x"][:3] for r in runs if r["vs_steady_x"]]
    if against_steady:
        medians = [statistics.median(r[i] for r in against_steady) for i in range(3)]
        print(
            "first three saves against the run's steady saves (4th and later), median of runs: "
            + " ".join(f"{x:.2f}x" for x in medians)
            + "; slowest: "
            + " ".join(f"{max(r[i] for r in against_steady):.2f}x" for i in range(3))
        )
    if args.json:
        summary = {
            "gib": args.gib,
            "gap_s": args.gap,
            "persist": args.persist,
            "runs": runs,
            "worst_blocked_x": worst,
            "first_three_within_target": max(first_three) <= TARGET_X,
        }
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
