"""Projection: what Transom's measured costs would mean on a real cluster for 30 days.

A trace-driven simulation (no jobs, no processes): seeded failure traces of a 30-day run on
1,024 nodes x 8 GPUs, drawn at the rates of published studies, are played against two systems,
Transom and torchrun + torch.save, each with its own costs per failure (detection, restart,
process-group set-up, reload, the work lost since the last checkpoint) and in steady state
(checkpoint saves that block training, step rate, start-up). It reports the effective training
time ratio (ETTR: fault-free training time done / wall time) of both, next to ByteRobust's
published 97%.

Transom's costs come from the other benchmarks' JSON (`--from recovery.json,overhead.json,
scale.json`: the last JSON line each printed with --json) or, by default, from the numbers in
README.md (each one says which table). Everything not measured here is an assumption, and the
output lists every assumption and every source with its value. Deterministic for a given --seed.

    python -m benchmarks.projection                # a table
    python -m benchmarks.projection --json         # the table, then one JSON line

This module only computes; it never starts a process.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

DAY_S = 86_400.0
BYTEROBUST_ETTR = 0.97  # ByteRobust (ByteDance, 2025): "ETTR up to 97%" over 3 months, 9,600 GPUs

# Failure kinds: what the fault looks like to the training job.
SOFTWARE = "software"  # a process ends (bug, NCCL error, OOM); the node stays usable
HARDWARE = "hardware"  # a GPU/host fails: its processes end and the node must be replaced
HANG = "hang"  # a hardware fault that ends nothing: the others wait in a collective


@dataclass(frozen=True)
class Cluster:
    """The run simulated, and the published failure rates it is drawn from."""

    nodes: int = 1024
    gpus_per_node: int = 8
    days: float = 30.0
    rate_source: str = "llama3"  # "llama3" or "meta" (see FAILURE_RATES)
    hardware_share: float = 0.78  # Llama 3: 78% of unexpected interruptions were hardware
    hang_share_of_hardware: float = 0.10  # ASSUMPTION: 1 hardware fault in 10 ends no process
    step_s: float = 5.0  # ASSUMPTION: one training step at this scale
    state_bytes: float = 405e9 * 16  # ASSUMPTION: a 405B model, bf16 + fp32 master + Adam: 16 B
    storage_bytes_per_s: float = 2e12  # Llama 3's checkpoint storage: 2 TB/s sustained
    pg_init_s: float = 30.0  # ASSUMPTION: NCCL set-up of 8,192 ranks, the same for both systems

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def shard_gib(self) -> float:
        return self.state_bytes / self.gpus / 2**30


# Mean time to failure of one job, in hours, at `gpus` GPUs. Both scale as 1/GPUs (failures of
# independent parts), which the Meta study reports holds: 7.9 h at 1,024 GPUs falling to ~1.8 h
# at 16,384 ("Revisiting Reliability in Large-Scale ML Research Clusters", Kokolis et al. 2024).
FAILURE_RATES = {
    "meta": (1024, 7.9, "Meta RSC study (Kokolis et al. 2024): MTTF 7.9 h for 1,024-GPU jobs"),
    "llama3": (
        16384,
        54 * 24 / 419,
        "Llama 3 (Dubey et al. 2024): 419 unexpected interruptions in 54 days, 16,384 GPUs",
    ),
}


def mttf_h(cluster: Cluster) -> float:
    gpus_ref, mttf_ref_h, _ = FAILURE_RATES[cluster.rate_source]
    return mttf_ref_h * gpus_ref / cluster.gpus


@dataclass(frozen=True)
class System:
    """One system's costs, in seconds at the cluster's scale."""

    name: str
    detect_s: dict[str, float]  # failure kind -> time until the system acts
    restart_s: dict[str, float]  # failure kind -> from detection to new workers started
    reload_s: dict[str, float]  # failure kind -> new workers started to state loaded
    save_block_s: float  # training blocked by one checkpoint save
    step_rate_x: float  # steady-state step rate against torchrun's
    startup_s: float  # launch to the first step (once per run)
    ckpt_interval_s: float  # training time between two checkpoints

    def recovery_s(self, kind: str, cluster: Cluster) -> float:
        return self.detect_s[kind] + self.restart_s[kind] + cluster.pg_init_s + self.reload_s[kind]


def daly_interval_s(save_s: float, mttf_s: float, step_s: float) -> float:
    """Young/Daly's checkpoint interval sqrt(2 C M), at least one step."""
    return max(step_s, math.sqrt(2.0 * save_s * mttf_s))


def failure_trace(cluster: Cluster, seed: int) -> list[tuple[float, str]]:
    """(time s, kind) of every failure in the run: a Poisson process at the cluster's rate."""
    rng = random.Random(seed)
    rate = 1.0 / (mttf_h(cluster) * 3600.0)
    end = cluster.days * DAY_S
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return out
        if rng.random() >= cluster.hardware_share:
            kind = SOFTWARE
        else:
            kind = HANG if rng.random() < cluster.hang_share_of_hardware else HARDWARE
        out.append((t, kind))


def simulate(system: System, cluster: Cluster, trace: list[tuple[float, str]]) -> dict:
    """Play `trace` against `system`: useful training time and where the rest went.

    The job starts, trains in cycles of `ckpt_interval_s` of training plus a blocking save, and
    at each failure loses the training since its last complete checkpoint, then recovers; a
    failure during a recovery starts the recovery again. Useful time is counted in fault-free
    torchrun seconds (training time x step_rate_x).
    """
    end = cluster.days * DAY_S
    cycle = system.ckpt_interval_s + system.save_block_s
    lost = {"startup": min(end, system.startup_s), "recovery": 0.0, "lost_work": 0.0, "saves": 0.0}
    useful = 0.0
    resume_at = system.startup_s  # wall time training (re)starts
    for when, kind in [*trace, (end, "")]:
        if when < resume_at:  # failed again while recovering: the recovery starts over
            lost["recovery"] -= resume_at - when
        else:
            trained = when - resume_at
            cycles = math.floor(trained / cycle)
            saved = cycles * system.ckpt_interval_s
            rest = trained - cycles * cycle
            lost["saves"] += cycles * system.save_block_s
            if kind:  # a failure: the work since the last checkpoint is lost
                lost["lost_work"] += rest
                useful += saved
            else:  # the run's end: what was trained counts
                useful += saved + rest
        if kind:
            recovery = system.recovery_s(kind, cluster)
            lost["recovery"] += recovery
            resume_at = when + recovery
    compute = useful  # wall seconds spent training that were kept
    useful = compute * system.step_rate_x
    lost["slower_steps"] = compute - useful
    return {"ettr": useful / end, "useful_s": useful, "lost_s": lost, "failures": len(trace)}


# -- the two systems' costs ----------------------------------------------------------------------

# Transom's costs on this machine, from README.md (2026-11-29; shared 2-core VM):
README_DEFAULTS = {
    "crash_detect_s": (0.25, "README Recovery numbers: transom worker SIGKILL, detection"),
    "crash_restart_s": (0.78, "README Recovery numbers: transom worker SIGKILL, restart"),
    "crash_reload_s": (0.34, "README Recovery numbers: transom worker SIGKILL, reload"),
    "node_detect_s": (1.37, "README Recovery numbers: transom node death, detection"),
    "node_restart_s": (2.85, "README Recovery numbers: transom node death, restart (spare)"),
    "node_reload_s": (0.36, "README Recovery numbers: transom node death, reload"),
    "hang_detect_s": (8.07, "README Detection numbers: hang (SIGSTOP) p50"),
    "torchrun_restart_s": (0.49, "README Recovery numbers: torchrun, restart with detection"),
    "torchrun_reload_s": (5.18, "README Recovery numbers: torchrun, reload (imports + load)"),
    "save_block_s_per_gib": (0.132, "README checkpoint table: 1 GiB, 1 rank, save"),
    "load_mem_s_per_gib": (0.128, "README checkpoint table: 1 GiB, 1 rank, load mem"),
    "load_peer_s_per_gib": (0.93, "README checkpoint table: 1 GiB, 1 rank, load peer"),
    "torch_save_s_per_gib": (0.95, "README checkpoint table: 1 GiB, 1 rank, torch.save"),
    "torch_load_s_per_gib": (0.56, "README checkpoint table: 1 GiB, 1 rank, torch.load"),
    "step_rate_x": (0.044 / 0.05, "README Goodput: fault-free 4-node median step 0.05 s vs 0.044"),
    "startup_delta_s": (12.7 - 9.0, "README Goodput: start-up 12.7 s (transom) vs 9.0 s"),
    "torchrun_startup_s": (9.0, "README Goodput: torchrun start-up 9.0 s"),
    "control_plane_s": (0.0, "no scale.json given: no extra control-plane latency at 1,024 nodes"),
}

# torchrun's costs that nothing here measures:
TORCHRUN_ASSUMPTIONS = {
    "hang_detect_s": (600.0, "torch's default NCCL collective timeout, 10 min"),
    "replace_node_s": (600.0, "ASSUMPTION: the scheduler re-queues the job on a new node, 10 min"),
}


def measured_costs(paths: list[Path]) -> dict[str, tuple[float, str]]:
    """README_DEFAULTS with what the given benchmark outputs measured put in their place."""
    costs = dict(README_DEFAULTS)
    for path in paths:
        lines = [x for x in path.read_text().splitlines() if x.strip().startswith("{")]
        if not lines:
            raise ValueError(f"{path}: no JSON line (run the benchmark with --json)")
        data = json.loads(lines[-1])
        src = f"{path.name}"
        if "transom_worker_crash" in data:  # recovery.py
            for prefix, scenario in (
                ("crash", "transom_worker_crash"),
                ("node", "transom_node_death"),
            ):
                row = data[scenario]
                for part in ("detect", "restart", "reload"):
                    value = row.get("detection_s" if part == "detect" else f"{part}_s")
                    if value is not None:
                        costs[f"{prefix}_{part}_s"] = (value, f"{src}: {scenario}")
            tr = data["torchrun_worker_crash"]
            costs["torchrun_restart_s"] = (tr["restart_s"], f"{src}: torchrun_worker_crash")
            costs["torchrun_reload_s"] = (tr["reload_s"], f"{src}: torchrun_worker_crash")
        if "step_rate_x" in data:  # job_overhead.py
            costs["step_rate_x"] = (data["step_rate_x"], f"{src}: step_rate_x")
            costs["startup_delta_s"] = (data["startup_delta_s"], f"{src}: startup_delta_s")
        if "sizes" in data and data["sizes"]:  # scale.py: its largest size
            top = max(data["sizes"], key=lambda r: r["nodes"])
            costs["control_plane_s"] = (
                top["fault_to_all_acting_s"],
                f"{src}: fault_to_all_acting_s at {top['nodes']} nodes, added to every "
                "hardware fault's recovery (counted twice for the 3-node share)",
            )
    return costs


def systems(cluster: Cluster, costs: dict[str, tuple[float, str]]) -> tuple[System, System]:
    c = {k: v for k, (v, _) in costs.items()}
    mttf_s = mttf_h(cluster) * 3600.0
    shard = cluster.shard_gib
    storage_s = cluster.state_bytes / cluster.storage_bytes_per_s  # all ranks at once
    transom_save = c["save_block_s_per_gib"] * shard
    hang_transom = max(c["hang_detect_s"], 4.0 * cluster.step_s)  # max(floor, 4 x median step)
    node_reload = c["node_reload_s"] + c["load_peer_s_per_gib"] * shard
    transom = System(
        name="transom",
        detect_s={
            SOFTWARE: c["crash_detect_s"],
            HARDWARE: c["node_detect_s"] + c["control_plane_s"],
            HANG: hang_transom + c["control_plane_s"],
        },
        restart_s={
            SOFTWARE: c["crash_restart_s"],
            HARDWARE: c["node_restart_s"],
            HANG: c["node_restart_s"],
        },  # fmt: skip
        reload_s={
            SOFTWARE: c["crash_reload_s"] + c["load_mem_s_per_gib"] * shard,
            HARDWARE: node_reload,
            HANG: node_reload,
        },  # fmt: skip
        save_block_s=transom_save,
        step_rate_x=c["step_rate_x"],
        startup_s=c["torchrun_startup_s"] + c["startup_delta_s"],
        ckpt_interval_s=daly_interval_s(transom_save, mttf_s, cluster.step_s),
    )
    torch_save = max(c["torch_save_s_per_gib"] * shard, storage_s)
    torch_reload = c["torchrun_reload_s"] + max(c["torch_load_s_per_gib"] * shard, storage_s)
    replace = TORCHRUN_ASSUMPTIONS["replace_node_s"][0]
    torchrun = System(
        name="torchrun + torch.save",
        detect_s={SOFTWARE: 0.0, HARDWARE: 0.0, HANG: TORCHRUN_ASSUMPTIONS["hang_detect_s"][0]},
        restart_s={
            SOFTWARE: c["torchrun_restart_s"],
            HARDWARE: c["torchrun_restart_s"] + replace,
            HANG: c["torchrun_restart_s"] + replace,
        },  # fmt: skip
        reload_s={k: torch_reload for k in (SOFTWARE, HARDWARE, HANG)},
        save_block_s=torch_save,
        step_rate_x=1.0,
        startup_s=c["torchrun_startup_s"],
        ckpt_interval_s=daly_interval_s(torch_save, mttf_s, cluster.step_s),
    )
    return transom, torchrun


def project(cluster: Cluster, costs: dict, seed: int, traces: int) -> dict:
    """ETTR of both systems over `traces` seeded failure traces (the same traces for both)."""
    transom, torchrun = systems(cluster, costs)
    runs = [failure_trace(cluster, seed + i) for i in range(traces)]
    out: dict = {"systems": {}}
    for system in (transom, torchrun):
        results = [simulate(system, cluster, trace) for trace in runs]
        ettrs = sorted(r["ettr"] for r in results)
        lost = {k: statistics.mean(r["lost_s"][k] for r in results) / 3600.0
                for k in results[0]["lost_s"]}  # fmt: skip
        out["systems"][system.name] = {
            "ettr_mean": statistics.mean(ettrs),
            "ettr_min": ettrs[0],
            "ettr_max": ettrs[-1],
            "lost_hours_mean": lost,
            "ckpt_interval_s": system.ckpt_interval_s,
            "save_block_s": system.save_block_s,
            "recovery_s": {k: system.recovery_s(k, cluster) for k in (SOFTWARE, HARDWARE, HANG)},
            "step_rate_x": system.step_rate_x,
        }
    out["failures_mean"] = statistics.mean(len(t) for t in runs)
    out["mttf_h"] = mttf_h(cluster)
    out["byterobust_ettr"] = BYTEROBUST_ETTR
    return out


def assumptions(cluster: Cluster, costs: dict) -> list[str]:
    gpus_ref, mttf_ref, source = FAILURE_RATES[cluster.rate_source]
    lines = [
        f"cluster: {cluster.nodes} nodes x {cluster.gpus_per_node} GPUs = {cluster.gpus} GPUs, "
        f"{cluster.days:g} days",
        f"failure rate: {source} -> MTTF {mttf_ref:.2f} h at {gpus_ref} GPUs, scaled as 1/GPUs "
        f"-> {mttf_h(cluster):.2f} h here; failures a Poisson process on wall time",
        f"kinds: {cluster.hardware_share:.0%} hardware (Llama 3), of which "
        f"{cluster.hang_share_of_hardware:.0%} end no process (a hang; ASSUMPTION); the rest "
        "software (the node stays usable)",
        f"step {cluster.step_s:g} s (ASSUMPTION); state {cluster.state_bytes / 1e12:.2f} TB "
        f"(ASSUMPTION: 405B params x 16 B) = {cluster.shard_gib:.2f} GiB per GPU rank",
        f"storage {cluster.storage_bytes_per_s / 1e12:g} TB/s aggregate (Llama 3's checkpoint "
        "storage; most clusters have less, which only hurts torch.save)",
        f"process-group set-up after every restart: {cluster.pg_init_s:g} s for both (ASSUMPTION)",
        "checkpoint interval: Young/Daly sqrt(2 x save x MTTF) per system, at least one step",
        "Transom's costs per GiB measured with 1-2 ranks on one 2-core VM and scaled linearly "
        "with the shard; its replica is assumed complete before the next failure",
        "Transom's hardware faults: a hot spare is ready (the pool is refilled); torchrun's: the "
        "job waits for a replacement node",
        "torchrun sees a crash or a lost node at once (its peers' connections close); a hang only "
        "at the collective timeout",
        "useful time counts fault-free torchrun seconds: Transom's step_rate_x scales its share",
    ]
    lines += [f"torchrun: {k} = {v:g} ({why})" for k, (v, why) in TORCHRUN_ASSUMPTIONS.items()]
    lines += [f"measured cost: {k} = {v:.3f} ({why})" for k, (v, why) in costs.items()]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument(
        "--from",
        dest="sources",
        default="",
        help="comma-separated outputs of recovery.py/job_overhead.py/scale --json",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--traces", type=int, default=50, help="failure traces (default 50)")
    parser.add_argument("--rates", choices=sorted(FAILURE_RATES), default="llama3")
    parser.add_argument("--nodes", type=int, default=Cluster.nodes)
    parser.add_argument("--days", type=float, default=Cluster.days)
    args = parser.parse_args()
    cluster = Cluster(nodes=args.nodes, days=args.days, rate_source=args.rates)
    costs = measured_costs([Path(p) for p in args.sources.split(",") if p])
    result = project(cluster, costs, args.seed, args.traces)
    result["assumptions"] = assumptions(cluster, costs)
    result["cluster"] = asdict(cluster)
    result["sensitivity"] = {}
    for rates in sorted(FAILURE_RATES):  # the other study's rates, and no steady-state overhead
        for rate_x in (costs["step_rate_x"][0], 1.0):
            c = dict(costs) | {"step_rate_x": (rate_x, "sensitivity")}
            r = project(Cluster(nodes=args.nodes, days=args.days, rate_source=rates), c,
                        args.seed, args.traces)  # fmt: skip
            result["sensitivity"][f"{rates}, transom step_rate_x {rate_x:.2f}"] = {
                name: s["ettr_mean"] for name, s in r["systems"].items()
            }
    print(
        f"{cluster.days:g} days, {cluster.gpus} GPUs, MTTF {result['mttf_h']:.2f} h, "
        f"{result['failures_mean']:.0f} failures on average over {args.traces} traces"
    )
    print(f"{'system':<24}{'ETTR':>8}{'min':>8}{'max':>8}{'ckpt every':>12}{'recovery hw':>13}")
    for name, s in result["systems"].items():
        print(f"{name:<24}{s['ettr_mean']:>8.3f}{s['ettr_min']:>8.3f}{s['ettr_max']:>8.3f}"
              f"{s['ckpt_interval_s']:>11.0f}s{s['recovery_s'][HARDWARE]:>12.0f}s")  # fmt: skip
    print(f"{'ByteRobust (published)':<24}{BYTEROBUST_ETTR:>8.3f}")
    for key, row in result["sensitivity"].items():
        print(f"  {key}: " + ", ".join(f"{n} {v:.3f}" for n, v in row.items()))
    print("assumptions:")
    for line in result["assumptions"]:
        print(f"  - {line}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
