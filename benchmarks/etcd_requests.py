"""What a node asks of etcd and the CPU its control plane uses, in a steady job (issue 44).

Issue 44's bars: at most 1 etcd request a node a second, and the control plane (etcd, agents,
controllers, launcher) at most 0.01 of a core a node, in a steady job with checkpoints.

Runs the overhead benchmark's Transom job alone (`benchmarks.job_overhead.transom`: examples/
train_gpt.py, `--nnodes 2 --nproc-per-node 1`, a checkpoint every --ckpt-every steps, all of
them persisted, or with --persist-every P those of multiples of P) --runs times, reads the
embedded etcd's request counts by method (its /metrics, every --requests-every seconds) over
each run's steady state, and prints them a second and a node a second, by method, with the mean
over the runs; and the CPU of each kind of control-plane process over the same steady state
(`job_overhead.Sampler`, from /proc), in cores a node. Which of Transom's writes a method is
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
TARGET_CORES_PER_NODE = 0.01  # issue 44: the control plane's CPU a node
CONTROL_PLANE = ("etcd", "agents", "controllers", "launcher")  # job_overhead.kind_of's kinds


def control_plane_cores(cores: dict[str, float], nodes: int) -> dict[str, float]:
    """The control plane's CPU a node, by kind and in all, from one job's `cores`."""
    out = {k: cores.get(k, 0.0) / nodes for k in CONTROL_PLANE}
    return out | {"total": sum(out.values())}


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
    runs, step_rates, cpu_runs = [], [], []
    with tempfile.TemporaryDirectory(prefix="transom-etcd-requests-") as tmp:
        for i in range(args.runs):
            result = job_overhead.transom(Path(tmp), job_args)
            per_node = {k: v / result["nodes"] for k, v in result["requests"].items()}
            runs.append(per_node)
            step_rates.append(result["step_rate"])
            cpu_runs.append(control_plane_cores(result["cores"], result["nodes"]))
            print(
                f"run {i + 1}/{args.runs}: {per_node.get('total', 0.0):.2f} requests a node a "
                f"second, control plane {cpu_runs[-1]['total']:.4f} cores a node, at "
                f"{result['step_rate']:.1f} steps/s",
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
    cpu = {k: statistics.mean(r[k] for r in cpu_runs) for k in cpu_runs[0]}
    print("control plane, cores a node (steady state, mean of the runs): " + ", ".join(
        f"{k} {v:.4f}" for k, v in cpu.items()))  # fmt: skip
    print(f"(target at most {TARGET_CORES_PER_NODE:g}: "
          f"{'met' if cpu['total'] <= TARGET_CORES_PER_NODE else 'missed'})")  # fmt: skip
    if args.json:
        print(json.dumps({
            "per_node_s": mean, "runs": runs,
            "cores_per_node": cpu, "cpu_runs": cpu_runs,
            "target_cores_per_node": TARGET_CORES_PER_NODE,
            "nodes": job_overhead.NODES, "steps": args.steps,
            "ckpt_every": args.ckpt_every, "persist_every": args.persist_every,
            "target_per_node_s": TARGET_PER_NODE_S,
            "step_rates": step_rates,
        }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
