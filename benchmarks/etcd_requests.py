"""etcd's requests a node a second in a steady fault-free job with checkpoints (issue 44: <= 1).

Runs the overhead benchmark's Transom job alone (`benchmarks.job_overhead.transom`: examples/
train_gpt.py, `--nnodes 2 --nproc-per-node 1`, a checkpoint every --ckpt-every steps, all of
them persisted, or with --persist-every P those of multiples of P) --runs times, reads the
embedded etcd's request counts by method (its /metrics, every --requests-every seconds) over
each run's steady state, and prints them a second and a node a second, by method, with the mean
over the runs. Which of Transom's writes a method is
made of is in docs/control-plane.md ("What a node agent asks of etcd").

    python -m benchmarks.etcd_requests --runs 3 --json
    python -m benchmarks.etcd_requests --ckpt-every 1 --persist-every 200   # snapshots

It measures only: it never changes the job it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import job_overhead

TARGET_PER_NODE_S = 1.0  # issue 44: at most 1 request a node a second


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="jobs, one after another (3)")
    parser.add_argument("--steps", type=int, default=1200, help="steps per job (1200)")
    parser.add_argument("--ckpt-every", type=int, default=20, help="checkpoint interval (20)")
    parser.add_argument(
        "--persist-every",
        type=int,
        default=0,
        help="persist only the checkpoints of multiples of this step (0: every one)",
    )
    parser.add_argument(
        "--requests-every",
        type=float,
        default=job_overhead.REQUESTS_EVERY_S,
        help=f"seconds between reads of etcd's counts ({job_overhead.REQUESTS_EVERY_S:g})",
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    job_args = argparse.Namespace(
        steps=args.steps,
        ckpt_every=args.ckpt_every,
        persist_every=args.persist_every,
        warm_workers=True,
        requests_every=args.requests_every,
    )
    runs, step_rates = [], []
    with tempfile.TemporaryDirectory(prefix="transom-etcd-requests-") as tmp:
        for i in range(args.runs):
            result = job_overhead.transom(Path(tmp), job_args)
            per_node = {k: v / result["nodes"] for k, v in result["requests"].items()}
            runs.append(per_node)
            step_rates.append(result["step_rate"])
            print(
                f"run {i + 1}/{args.runs}: {per_node.get('total', 0.0):.2f} requests a node a "
                f"second at {result['step_rate']:.1f} steps/s",
                file=sys.stderr,
                flush=True,
            )
    methods = sorted({m for r in runs for m in r}, key=lambda m: -runs[0].get(m, 0.0))
    mean = {m: statistics.mean(r.get(m, 0.0) for r in runs) for m in methods}
    print("etcd requests a node a second (steady state, mean of the runs): " + ", ".join(
        f"{m} {v:.2f}" for m, v in mean.items()))  # fmt: skip
    total = mean.get("total", 0.0)
    print(f"total {total:.2f} (target at most {TARGET_PER_NODE_S:g}: "
          f"{'met' if total <= TARGET_PER_NODE_S else 'missed'})")  # fmt: skip
    if args.json:
        print(json.dumps({
            "per_node_s": mean, "runs": runs, "nodes": job_overhead.NODES, "steps": args.steps,
            "ckpt_every": args.ckpt_every, "persist_every": args.persist_every,
            "target_per_node_s": TARGET_PER_NODE_S,
            "step_rates": step_rates,
        }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
