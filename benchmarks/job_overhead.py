"""Overhead benchmark: the same fault-free job under torchrun and under `transom run`.

Runs examples/train_gpt.py (2 ranks, a checkpoint every --ckpt-every steps) in alternating pairs:
  torchrun   `torchrun --standalone --nproc-per-node 2`, torch.save checkpoints (rank 0 writes)
  transom    `transom run --nnodes 2 --nproc-per-node 1`, Transom's checkpoint engine (every
             checkpoint in memory and a peer's; to storage every one, or with --persist-every P
             only steps that are multiples of P)
and reports, from rank 0's step lines and psutil samples of every process each job started:
  step_rate_x      steady-state steps/s under Transom / under torchrun (steps 20%..85% of the run)
  startup_delta_s  Transom's time from launch to the first step, less torchrun's
  ramp_delta_s     Transom's ramp less torchrun's: a job's ramp is how much longer it took from
                   its first step to the steady state's than its steady rate would take (what
                   slows the first steps: warm-up, caches, the first checkpoints' regions).
                   No target;
                   startup_delta_s + ramp_delta_s is what Transom costs a generation before the
                   steady state
  transom_cpu_x    CPU of Transom's own processes over the steady state, in cores, by kind
                   (etcd, checkpoint servers, agents, controllers, launcher, warm interpreters
                   waiting, other); the workers are not Transom's and are reported apart
  transom_cpu_per_node_x  the same without the checkpoint servers, per node (the issue's bar)
  etcd_requests_per_s     etcd's requests a second over the steady state, by method (its
                          metrics, read every REQUESTS_EVERY_S or --requests-every)
Numbers are means over the pairs, each ratio and difference with its 95% bootstrap interval
over the pairs (stats.py; `*_ci95`), and a verdict per target of the issue (step_rate_x at least
0.97, startup_delta_s below 2 s, transom_cpu_per_node_x below 0.03): met or missed when the
whole interval says so, else "not shown either way". On this shared machine single pairs scatter
by several percent: read the interval, not the mean.

With --isolate-ranks the ranks get cores of their own, as on a real node (benchmarks/isolation.py):
1 node, half the cores' ranks (on 2 cores: 1 rank on core 1), every other process of both systems
(and the benchmark) on the other cores; the targets are then those of issue 44 (step_rate_x at
least 0.99, ramp_delta_s and startup_delta_s below 0.5 s and 1 s). Without it everything shares
every core: the worst case.

    flock /work/wt/e2e.lock timeout 600 python -m benchmarks.job_overhead --json

This module starts jobs and stops every process they started; it never changes the job.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

from benchmarks import REPO, isolation, stats
from transom.control.warm import TITLE as WARM_TITLE
from transom.store import Store  # noqa: E402
from transom.testing.jobs import (
    Line,
    embedded_etcd,
    etcd_access,
    etcd_requests_by_method,
    finish,
    parse,
    transom_run,
)
from transom.utils.procs import new_session_dying_with_parent, stop_tree  # noqa: E402

SCRIPT = REPO / "examples" / "train_gpt.py"
RUN_TIMEOUT_S = 240
# A job in its own session, SIGTERMed (it stops its workers) when the benchmark dies.
JOB_DIES_WITH_US = functools.partial(new_session_dying_with_parent, signal.SIGTERM)
SAMPLE_EVERY_S = 0.5
STEADY = (0.20, 0.85)  # the steady state: from this share of the steps to that one
REQUESTS_EVERY_S = 5.0  # reading etcd's metrics costs it some CPU too
NODES = 2  # transom's nodes in the job (--nnodes), one rank each
ISOLATED_NODES = 1  # with --isolate-ranks: one node, its ranks on cores of their own
PAIRS = 4  # fewer leave the intervals little to say
TIMES = ("startup_s", "ramp_s", "step_rate", "wall_s")
TRANSOM_KINDS = ("etcd", "ckpt_servers", "agents", "controllers", "launcher", "warm", "other")
# The bars: (target, whether a value must be at least it (else below it)).
TARGETS = {
    "step_rate_x": (0.97, True),
    "startup_delta_s": (2.0, False),
    "transom_cpu_per_node_x": (0.03, False),
}
# ... and with the ranks on cores of their own (issue 44).
ISOLATED_TARGETS = {
    "step_rate_x": (0.99, True),
    "ramp_delta_s": (0.5, False),
    "startup_delta_s": (1.0, False),
    "transom_cpu_per_node_x": (0.03, False),
}


def kind_of(cmdline: list[str], is_root: bool) -> str:
    """What one process of a job is, from its command line (or its setproctitle title)."""
    text = " ".join(cmdline)
    words = text.split()
    if "torch.distributed.run" in words:
        return "torchrun"
    if is_root:
        return "launcher"
    if words and Path(words[0]).name == "etcd":
        return "etcd"
    if "transom.checkpoint.server" in words or "ckpt-server" in words:
        return "ckpt_servers"
    if WARM_TITLE in text or "transom.control.warm" in words:
        return "warm"
    if "train_gpt" in text:
        return "workers"
    if "agent" in words:
        return "agents"
    if "controller" in words:
        return "controllers"
    return "other"


class Sampler:
    """CPU seconds of every process under `root`, by pid, every SAMPLE_EVERY_S."""

    def __init__(self, root: int):
        self.root = root
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self.procs: dict[int, psutil.Process] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(SAMPLE_EVERY_S):
            try:
                tree = [psutil.Process(self.root), *psutil.Process(self.root).children(True)]
            except psutil.NoSuchProcess:
                return
            sample: dict[int, tuple[str, float]] = {}
            for p in tree:
                try:
                    p = self.procs.setdefault(p.pid, p)
                    cpu = p.cpu_times()
                    sample[p.pid] = (
                        kind_of(p.cmdline(), p.pid == self.root),
                        cpu.user + cpu.system,
                    )
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            self.samples.append((time.time(), sample))

    def cores(self, start: float, end: float) -> dict[str, float]:
        """Cores used by each kind of process between `start` and `end` (wall times)."""
        inside = [(t, s) for t, s in self.samples if start <= t <= end]
        if len(inside) < 2:
            raise RuntimeError("too few CPU samples in the steady state (a run too short?)")
        (t0, first), (t1, last) = inside[0], inside[-1]
        seen: dict[int, tuple[str, float]] = {}  # pid -> (kind, cpu at its first sample inside)
        for _, sample in inside:
            for pid, value in sample.items():
                seen.setdefault(pid, value)
        out: dict[str, float] = {}
        for pid, (kind, cpu) in last.items():
            base = first[pid][1] if pid in first else seen[pid][1]
            out[kind] = out.get(kind, 0.0) + (cpu - base) / (t1 - t0)
        return out


class EtcdRequests:
    """etcd's request counts by method, read every `every_s` from the embedded etcd of the job
    in `run_dir`."""

    def __init__(self, run_dir: Path, job_id: str, every_s: float = REQUESTS_EVERY_S):
        self.run_dir, self.job_id, self.every_s = run_dir, job_id, every_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="etcd-requests", daemon=True)

    def _run(self) -> None:
        etcd = None
        while etcd is None and not self.stop.wait(SAMPLE_EVERY_S):
            etcd = embedded_etcd(self.run_dir)
        if etcd is None:
            return
        try:
            access = etcd_access(etcd, self.run_dir)
        except psutil.Error:  # it exited already
            return
        store = Store(access, self.job_id)
        while not self.stop.is_set():
            try:
                self.samples.append((time.time(), etcd_requests_by_method(store)))
            except Exception:  # noqa: BLE001 - not serving yet, or gone at the end
                if self.samples:  # gone: the samples so far count
                    return
                self.stop.wait(SAMPLE_EVERY_S)
                continue
            self.stop.wait(self.every_s)

    def rates(self, start: float, end: float) -> dict[str, float]:
        """Requests a second by method between the first and last samples in [start, end]."""
        inside = [(t, c) for t, c in self.samples if start <= t <= end]
        if len(inside) < 2:
            raise RuntimeError("too few etcd metrics samples in the steady state")
        (t0, first), (t1, last) = inside[0], inside[-1]
        rates = {k: (v - first.get(k, 0.0)) / (t1 - t0) for k, v in last.items()}
        rates = {k: v for k, v in sorted(rates.items()) if v > 0}
        return rates | {"total": sum(rates.values())}


def rank0_steps(lines: list[Line]) -> dict[int, float]:
    return {x.step: x.t for x in lines if x.what == "step" and x.step is not None}


def steady_steps(steps: int) -> tuple[int, int]:
    """The first and last step of a run's steady state."""
    first, last = (max(2, int(steps * share)) for share in STEADY)
    return first, last


def steady_rate_and_ramp(t: dict[int, float], steps: int) -> tuple[float, float]:
    """From the times rank 0 printed each step (`t`): the steady-state steps a second and the
    ramp, the seconds from step 1 to the steady state's first step beyond what that rate takes."""
    first, last = steady_steps(steps)
    rate = (last - first) / (t[last] - t[first])
    return rate, (t[first] - t[1]) - (first - 1) / rate


def run_job(
    command: list[str],
    logs,
    marker: str,
    out_path: Path,
    steps: int,
    requests: EtcdRequests | None = None,
    cores: isolation.Cores | None = None,
) -> dict:
    """Run one job to its end; its start-up, steady step rate, CPU by kind (and etcd's
    requests, given `requests`; with `cores`, its ranks on cores of their own and the
    affinities seen)."""

    def start() -> None:
        JOB_DIES_WITH_US()
        if cores is not None:
            isolation.use_rest(cores)

    with open(out_path, "wb") as out:
        launched = time.time()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, preexec_fn=start)
        samplers: list[Sampler | EtcdRequests | isolation.RankPinner] = [Sampler(process.pid)]
        samplers += [requests] if requests else []
        pinner = None
        if cores is not None:
            pinner = isolation.RankPinner(process.pid, cores, is_rank)
            samplers.append(pinner)
        for sampler in samplers:
            sampler.thread.start()
        try:
            ok = finish(process, marker, RUN_TIMEOUT_S)
        finally:
            for sampler in samplers:
                sampler.stop.set()
                sampler.thread.join()
            if process.poll() is None:  # interrupted: no job outlives the benchmark
                stop_tree([process.pid])
    if not ok:
        raise RuntimeError(f"{command[:4]}... failed; see {out_path}")
    t = rank0_steps(parse(logs()))
    first, last = steady_steps(steps)
    if 1 not in t or first not in t or last not in t or steps not in t:
        raise RuntimeError(f"rank 0 did not print steps 1, {first}, {last} and {steps}: {out_path}")
    rate, ramp_s = steady_rate_and_ramp(t, steps)
    sampler = samplers[0]
    assert isinstance(sampler, Sampler)
    return {
        "startup_s": t[1] - launched,
        "ramp_s": ramp_s,
        "step_rate": rate,
        "wall_s": t[steps] - launched,
        "cores": sampler.cores(t[first], t[last]),
        "requests": requests.rates(t[first], t[last]) if requests else {},
    } | (pinned(pinner) if pinner else {})


def is_rank(cmdline: list[str]) -> bool:
    return kind_of(cmdline, False) == "workers"


def pinned(pinner: isolation.RankPinner) -> dict:
    """What the pinner saw: the cores of each rank (by pid) and of everything else."""
    ranks = {str(pid): sorted(cores) for pid, cores in sorted(pinner.ranks.items())}
    return {"pinned": {"ranks": ranks, "rest": sorted(pinner.rest)}}


def torchrun(work: Path, args, cores: isolation.Cores | None = None) -> dict:
    run_id = "overhead-" + uuid.uuid4().hex[:6]
    out = work / f"{run_id}.out"
    ckpt = work / f"{run_id}-ckpt"
    ranks = str(len(cores.ranks) if cores else NODES)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", ranks,
        str(SCRIPT), "--steps", str(args.steps), "--log-every", "1",
        "--ckpt-every", str(args.ckpt_every), "--checkpoint", "torch", "--ckpt-dir", str(ckpt),
    ]  # fmt: skip
    logs = lambda: out.read_text(errors="replace")  # noqa: E731
    return run_job(command, logs, str(ckpt), out, args.steps, cores=cores)


def transom(work: Path, args, cores: isolation.Cores | None = None) -> dict:
    job_id = "overhead-" + uuid.uuid4().hex[:6]
    run_dir = work / job_id
    nodes, ranks = (ISOLATED_NODES, len(cores.ranks)) if cores else (NODES, 1)
    command = transom_run(
        run_dir, job_id, "--nnodes", str(nodes), "--nproc-per-node", str(ranks),
        *([] if args.warm_workers else ["--no-warm-workers"]),
        str(SCRIPT), "--steps", str(args.steps), "--log-every", "1",
        "--ckpt-every", str(args.ckpt_every), "--persist-every", str(args.persist_every),
    )  # fmt: skip

    def logs() -> str:
        paths = sorted(run_dir.glob("logs/g*/rank0.log"))
        return "".join(p.read_text(errors="replace") for p in paths)

    requests = EtcdRequests(run_dir, job_id, args.requests_every)
    out = work / f"{job_id}.out"
    return run_job(command, logs, str(run_dir), out, args.steps, requests, cores) | {"nodes": nodes}


def own_cores(cores: dict[str, float]) -> dict[str, float]:
    """The CPU of Transom's own processes in one job's sample, by kind."""
    return {k: v for k, v in cores.items() if k in TRANSOM_KINDS}


def per_node_without_servers(cores: dict[str, float], nodes: int = NODES) -> float:
    """Transom's CPU a node without the checkpoint servers' data movement (the issue's bar)."""
    own = own_cores(cores)
    return (sum(own.values()) - own.get("ckpt_servers", 0.0)) / nodes


def spread(name: str, values: list[float]) -> dict:
    """One measure over the pairs: its mean, 95% bootstrap interval and per-pair values."""
    return {
        name: statistics.mean(values),
        f"{name}_ci95": list(stats.interval(values)),
        f"{name}_pairs": values,
    }


def summarize(pairs: list[tuple[dict, dict]], targets_of: dict = TARGETS) -> dict:
    """Means over the pairs (torchrun, transom) of what the issue asks for, with the intervals
    and verdicts of its targets (`targets_of`: TARGETS or ISOLATED_TARGETS)."""
    per_pair = {
        "step_rate_x": [b["step_rate"] / a["step_rate"] for a, b in pairs],
        "ramp_delta_s": [b["ramp_s"] - a["ramp_s"] for a, b in pairs],
        "startup_delta_s": [b["startup_s"] - a["startup_s"] for a, b in pairs],
        "transom_cpu_per_node_x": [
            per_node_without_servers(b["cores"], b.get("nodes", NODES)) for _, b in pairs
        ],
    }
    kinds = {k for _, b in pairs for k in b["cores"]}
    cpu = {k: statistics.mean(b["cores"].get(k, 0.0) for _, b in pairs) for k in sorted(kinds)}
    own = own_cores(cpu)
    methods = {k for _, b in pairs for k in b["requests"]}
    requests = {k: statistics.mean(b["requests"].get(k, 0.0) for _, b in pairs) for k in methods}
    result: dict = {}
    targets = {}
    for name, values in per_pair.items():
        result |= spread(name, values)
        if name not in targets_of:
            continue  # measured, with no target in this mode
        low, high = result[f"{name}_ci95"]
        target, at_least = targets_of[name]
        targets[name] = {
            "target": target,
            "at_least": at_least,
            "verdict": stats.verdict(low, high, target, at_least),
        }
    return result | {
        "targets": targets,
        "step_rate_pairs": [[a["step_rate"], b["step_rate"]] for a, b in pairs],
        "transom_cpu_x": own | {"total": sum(own.values())},
        "etcd_requests_per_s": dict(sorted(requests.items(), key=lambda kv: -kv[1])),
        "transom_workers_cpu_x": cpu.get("workers", 0.0),
        "torchrun_cpu_x": {
            k: statistics.mean(a["cores"].get(k, 0.0) for a, _ in pairs)
            for k in ("torchrun", "workers")
        },
        "torchrun": {k: statistics.mean(a[k] for a, _ in pairs) for k in TIMES},
        "transom": {k: statistics.mean(b[k] for _, b in pairs) for k in TIMES},
    }


def describe_targets(result: dict) -> list[str]:
    """One line per target: the mean, its interval over the pairs and the verdict."""
    lines = []
    for name, t in result["targets"].items():
        low, high = result[f"{name}_ci95"]
        bar = f"{'>=' if t['at_least'] else '<'} {t['target']:g}"
        lines.append(
            f"{name} {result[name]:.3f} (95% CI {low:.3f} to {high:.3f} over "
            f"{len(result[f'{name}_pairs'])} pairs; target {bar}: {t['verdict']})"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--pairs", type=int, default=PAIRS, help=f"torchrun/transom pairs (default {PAIRS})"
    )
    parser.add_argument("--steps", type=int, default=1200, help="steps per job (default 1200)")
    parser.add_argument("--ckpt-every", type=int, default=20, help="checkpoint interval (20)")
    parser.add_argument(
        "--persist-every",
        type=int,
        default=0,
        help="transom: steps between checkpoints written to storage, the others in memory and a "
        "peer's (train_gpt's --persist-every; default 0: every checkpoint, as torch.save does)",
    )
    parser.add_argument(
        "--no-warm-workers",
        dest="warm_workers",
        action="store_false",
        help="transom: no warm interpreter (`transom run --no-warm-workers`): every worker "
        "starts cold, importing torch itself",
    )
    parser.add_argument(
        "--isolate-ranks",
        action="store_true",
        help="1 node, its ranks on cores of their own (half the cores; on 2 cores 1 rank on core "
        "1), every other process of both systems on the other cores (default: all share all)",
    )
    parser.add_argument(
        "--requests-every",
        type=float,
        default=REQUESTS_EVERY_S,
        help=f"seconds between two reads of etcd's request counts (default {REQUESTS_EVERY_S:g}; "
        "a short run needs at least two in its steady state)",
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    cores = None
    if args.isolate_ranks:
        available = sorted(os.sched_getaffinity(0))
        cores = isolation.split(available, isolation.ranks_for(available))
        isolation.use_rest(cores)  # the benchmark's own samplers stay off the ranks' cores
    pairs = []
    with tempfile.TemporaryDirectory(prefix="transom-overhead-") as tmp:
        for i in range(args.pairs):
            print(f"pair {i + 1}/{args.pairs}: torchrun ...", file=sys.stderr, flush=True)
            a = torchrun(Path(tmp), args, cores)
            print(f"pair {i + 1}/{args.pairs}: transom ...", file=sys.stderr, flush=True)
            b = transom(Path(tmp), args, cores)
            pairs.append((a, b))
            print(
                f"pair {i + 1}/{args.pairs}: torchrun {a['step_rate']:.1f} steps/s, transom "
                f"{b['step_rate']:.1f} steps/s (x{b['step_rate'] / a['step_rate']:.3f}); start-up "
                f"{a['startup_s']:.2f} s and {b['startup_s']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    result = summarize(pairs, ISOLATED_TARGETS if cores else TARGETS) | {
        "isolated": cores.to_dict() if cores else None,
        # with --isolate-ranks: the cores each pair's ranks and other processes were seen on
        "pinned_pairs": [[a.get("pinned"), b.get("pinned")] for a, b in pairs] if cores else None,
        "pairs": args.pairs,
        "steps": args.steps,
        "ckpt_every": args.ckpt_every,
        "persist_every": args.persist_every,
        "warm_workers": args.warm_workers,
        "cores": psutil.cpu_count(),
    }
    for name in ("torchrun", "transom"):
        r = result[name]
        print(f"{name:<9} start-up {r['startup_s']:6.2f} s  ramp {r['ramp_s']:5.2f} s  steady "
              f"{r['step_rate']:6.1f} steps/s  wall {r['wall_s']:6.1f} s")  # fmt: skip
    for line in describe_targets(result):
        print(line)
    print("Transom's own processes in the steady state (cores): " + ", ".join(
        f"{k} {v:.3f}" for k, v in result["transom_cpu_x"].items()))  # fmt: skip
    print("etcd requests a second: " + ", ".join(
        f"{k} {v:.2f}" for k, v in result["etcd_requests_per_s"].items()))  # fmt: skip
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
