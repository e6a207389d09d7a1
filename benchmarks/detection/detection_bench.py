"""Detection benchmark: how fast the monitor finds injected faults, whom it blames, what it costs.

For each fault type it runs ONE long `transom run` job of a training script (--nodes nodes, 3 by
default, x 1 worker): examples/train_gpt.py, which uses Transom's monitor API (--script gpt, the
default), or a plain script with no Transom import that the worker bootstrap instruments
(transom.monitor.auto): examples/ddp_unmodified.py (--script ddp, torchrun-style DDP) or
examples/hf_trainer_unmodified.py (--script hf, a Hugging Face Trainer). The plain scripts take
the fault types that need nothing of the script (not slow or nan, which the worker applies
through the monitor API). It injects --trials faults of that type into it one after another,
each at a random rank and a random step (seeded); fault types whose answer is an eviction (hang,
slow, throttle, log) need a spare per fault and a job has at most as many as nodes, so those run
in jobs of that many faults. `throttle` slows a rank from outside its process (the agent stops
and continues it, running 1/--throttle-factor of the time), as CPU throttling or a noisy
neighbour would; its row also gives the job's slowdown it caused (median step time after the
fault over before, rank 0's log). The slowdown shapes (`--types shapes`: duty cycles of 50/50,
75/25 and 300/300 ms stopped/run, and a cgroup CPU quota) are rows of their own, each scored like
throttle. Then it reads the jobs' event logs:
  detection latency   fault event -> the first anomaly of the matching type (p50, p95)
                      (and, for slow, throttle and nan, in training steps)
  attribution         the controller's decision (or diagnosis, for crashes) blames the node the
                      fault was injected on
  precision, recall   decisions that answer an injected fault / all decisions; faults detected
                      within DETECTION_WINDOW_S / faults fired
  overlapped          a slowdown from outside (throttle, quota) lasts until its worker exits:
                      a fault fired while an earlier one still slowed another node (not yet
                      found and evicted) is scored apart, recall, right node and latency being
                      over the others (such faults are also spaced PERSISTENT_SPACING_STEPS
                      apart, so that most are found before the next one fires)
A fault-free job with checkpoints and evaluation passes gives false positives per hour (any
anomaly above info severity, any decision), and single-process runs of train_gpt with the
monitor on and off (alternating pairs: benchmarks/monitor/overhead.py) give the step-time
overhead of monitoring with a 95% confidence interval.
The median step and the slowdowns come from rank 0's `step N [loss L] t=TIME` lines, which all
three scripts print after each step; a fault's step and its anomaly's are the monitor's numbers
(train_gpt's own; for a plain script the optimizer hook's, its optimizer's count from 0, one below
the script's step N: Workload.log_step_offset). The monitor overhead is measured for gpt only
(an unmodified loop's: `python -m benchmarks.monitor.overhead --auto`).
Without running anything, the log classifier (transom.monitor.patterns) is measured on the
corpora in tests/data/log_corpus: precision and recall of its hardware classifications
(`--patterns-only` measures just that).

Targets (issue 4): crash < 2 s; hang within max(10 s, 5 x median step); a 2x slower node within
30 steps; NaN within 1 step; right node >= 95%; no false positive in 30 fault-free minutes;
overhead < 1%.

    python -m benchmarks.detection --trials 20 --fault-free-minutes 30      # the full run
    python -m benchmarks.detection --json                                   # last line: JSON
    python -m benchmarks.detection --script ddp --types shapes,hang --nodes 2 --trials 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import REPO
from benchmarks.detection.table import print_table
from benchmarks.monitor.overhead import measure as measure_overhead
from transom.testing.jobs import transom_run

LOG_CORPUS = REPO / "tests" / "data" / "log_corpus"
from transom.common import anomaly_types, env  # noqa: E402
from transom.common.files import rank_log  # noqa: E402
from transom.faults import DETECTORS  # noqa: E402
from transom.monitor import patterns  # noqa: E402

NODES = 3
STEP_DELAY_S = 0.05
CKPT_EVERY = 10
FIRST_FAULT_STEP = 25
FAULT_SPACING_STEPS = (
    50  # between faults: room for detection, the restart and a checkpoint to resume from
)
# A slowdown from outside goes on until its worker exits (an eviction, a new generation): one
# not yet found when the next fault fires slows its node beside the next one's. Such faults are
# spaced further apart, and a trial fired while an earlier one still ran is scored apart
# (`score`: "overlapped"), so a find of the earlier node is not counted as the later one's.
PERSISTENT = ("throttle", "quota")
PERSISTENT_SPACING_STEPS = 100
DETECTION_WINDOW_S = 60.0
JOB_TIMEOUT_S = 1800
# The fault types measured (what detects each: transom.faults.DETECTORS), and those whose
# detection evicts the node, so that each fault needs a spare.
FAULTS = ("crash", "hang", "slow", "throttle", "nan", "log", "corrupt")
THROTTLE_FACTOR = 2.0  # the throttled rank runs half of the time
# Shapes of a slowdown from outside, each its own row (`--types shapes` runs them all): the fault
# type that plays it and its options. dutySTOP_RUN: stopped STOP ms, then run RUN ms, in turn;
# quota: a cgroup CFS quota of half the CPU the rank used (transom.faults.cpu_quota; needs a
# writable cgroup).
SHAPES = {
    "duty50_50": ("throttle", ":factor=2:period=0.1"),
    "duty75_25": ("throttle", ":factor=4:period=0.1"),
    "duty300_300": ("throttle", ":factor=2:period=0.6"),
    "quota": ("quota", ":factor=2"),
}
EVICTING = ("hang", "slow", "throttle", "log", "corrupt", *SHAPES)
SLOWED = ("slow", "throttle", "nan", "corrupt", *SHAPES)  # latencies also counted in steps
# corrupt: 2 low mantissa bits of one rank's parameters flip; the replicas' fingerprints, taken
# every FINGERPRINT_EVERY steps here, find it (transom.monitor.replicas).
FINGERPRINT_EVERY = 10
SLOWDOWN_STEPS = 15  # steps before the fault (and after it, to its detection) in its slowdown
TARGETS = {
    "crash_s": 2.0,
    "hang_floor_s": 10.0,
    "hang_step_factor": 5.0,
    "slow_steps": 30,
    "nan_steps": 1,
    "attribution": 0.95,
    "overhead": 0.01,
}
STEP_LINE = re.compile(r"^step (\d+)(?: loss \S+)? t=(\d+\.\d+)$", re.M)


@dataclass(frozen=True)
class Workload:
    """A script the benchmark runs: its file and command line, and how its numbers read."""

    name: str
    path: Path
    # argv after the script: (steps, the sleep a step, the fault-free job's extras?) -> options
    options: Callable[[int, float, bool], list[str]]
    # Uses Transom's monitor API (step sections, the loss): the worker-side slow and nan
    # faults, which the worker applies there, work only then.
    api: bool
    # Rank 0's log numbers a step this many above the monitor (its `step N` lines).
    log_step_offset: int
    # A fault-free step with its checkpoints, to size the fault-free job (seconds; on the
    # low side, so that the job lasts at least as long as asked).
    fault_free_step_s: float


def _gpt_options(steps: int, delay: float, fault_free: bool) -> list[str]:
    evaluation = ["--eval-every", "100", "--eval-batches", "200"] if fault_free else []
    return [
        *("--steps", str(steps), "--ckpt-every", str(CKPT_EVERY)),
        *("--step-delay", str(delay), "--log-every", "1", *evaluation),
    ]


WORKLOADS = {
    # A step with its checkpoints and evaluations took 0.13 s on this machine (3 nodes, 12,000
    # steps in 26.1 minutes, 2026-12-01), 0.097 s once workers forked from a warm interpreter
    # (17,500 steps in 28.3 minutes, 2026-12-05); 0.09 s leaves margin.
    "gpt": Workload("gpt", REPO / "examples" / "train_gpt.py", _gpt_options, True, 0, 0.09),
    # The plain scripts: their steps are the optimizer hook's (from 0), their `step N` from 1;
    # the sleep is their data delay (a batch arrives that much later), a step of a few tens of
    # ms besides. A fault-free step took 0.08-0.09 s on 2 nodes here (0.05 s of it the delay).
    "ddp": Workload(
        "ddp",
        REPO / "examples" / "ddp_unmodified.py",
        lambda steps, delay, _: [
            *("--steps", str(steps), "--ckpt-every", str(CKPT_EVERY), "--data-delay", str(delay))
        ],
        False,
        1,
        0.08,
    ),
    "hf": Workload(
        "hf",
        REPO / "examples" / "hf_trainer_unmodified.py",
        lambda steps, delay, _: [
            *("--steps", str(steps), "--save-steps", str(CKPT_EVERY), "--data-delay", str(delay))
        ],
        False,
        1,
        0.08,
    ),
}
# The fault types a script without the monitor API cannot take (the worker applies them there).
NEEDS_API = ("slow", "nan")


def supported(workload: Workload) -> tuple[str, ...]:
    """The fault types and shapes `workload` can be measured with."""
    return tuple(t for t in (*FAULTS, *SHAPES) if workload.api or t not in NEEDS_API)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def run_job(
    run_dir: Path,
    faults: str | None,
    spares: int,
    steps: int,
    fault_free: bool = False,
    nodes: int = NODES,
    step_delay_s: float = STEP_DELAY_S,
    log_level: str = "warning",
    timeout_s: float = JOB_TIMEOUT_S,
    workload: Workload = WORKLOADS["gpt"],
) -> list[dict]:
    """Run one job of `workload` to its end (stopped after `timeout_s`); its events.
    `fault_free`: with the script's extra work of the fault-free job (train_gpt's evaluations)."""
    argv = transom_run(
        run_dir,
        "d-" + uuid.uuid4().hex[:6],
        "--nnodes",
        str(nodes),
        "--spares",
        str(spares),
        "--max-restarts",
        "1000",
        "--evict-window",
        "0",
        *(["--faults", faults] if faults else []),
        str(workload.path),
        *workload.options(steps, step_delay_s, fault_free),
        log_level=log_level,
    )
    with open(run_dir.parent / f"{run_dir.name}.out", "wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # Nothing is downloaded: the Hugging Face script builds its model from a config.
            env={
                **os.environ,
                env.FINGERPRINT_EVERY: str(FINGERPRINT_EVERY),
                "HF_HUB_OFFLINE": "1",
            },
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def median_step_s(run_dirs: list[Path]) -> float | None:
    """Median time between consecutive steps of rank 0, over every generation."""
    gaps = []
    for log in sorted(p for d in run_dirs for p in d.glob("logs/g*/rank0.log")):
        points = [(int(s), float(t)) for s, t in STEP_LINE.findall(log.read_text(errors="replace"))]
        gaps += [
            t2 - t1 for (s1, t1), (s2, t2) in zip(points, points[1:], strict=False) if s2 == s1 + 1
        ]
    return statistics.median(gaps) if gaps else None


def slowdowns(run_dir: Path, events: list[dict], log_step_offset: int = 0) -> list[float]:
    """Per fired fault: how many times as long the job took for the SLOWDOWN_STEPS steps after
    the fault as for the SLOWDOWN_STEPS before it (rank 0's log, in the fault's generation, whose
    step numbers are the monitor's plus `log_step_offset`). A mean, not a median: a slowdown that
    hits half of the steps makes the job that much slower."""
    out = []
    for f in (e for e in events if e["kind"] == "fault" and e.get("step") is not None):
        log = rank_log(run_dir, f.get("generation") or 0, 0)
        if not log.exists():
            continue
        points = dict(
            (int(s), float(t)) for s, t in STEP_LINE.findall(log.read_text(errors="replace"))
        )
        at = f["step"] + log_step_offset
        before = _gaps(points, range(at - SLOWDOWN_STEPS, at))
        after = _gaps(points, range(at + 2, at + 2 + SLOWDOWN_STEPS))
        if len(before) >= 5 and len(after) >= 5:
            out.append(round(statistics.fmean(after) / statistics.fmean(before), 3))
    return out


def _gaps(points: dict[int, float], steps: range) -> list[float]:
    return [points[s] - points[s - 1] for s in steps if s in points and s - 1 in points]


def schedule(
    kind: str,
    trials: int,
    rng: random.Random,
    nodes: int = NODES,
    throttle_factor: float = THROTTLE_FACTOR,
) -> tuple[str, int]:
    """A fault spec of `trials` faults of one type at random ranks and steps; the steps to run."""
    items, step = [], FIRST_FAULT_STEP
    options = {
        "slow": ":factor=2",
        "throttle": f":factor={throttle_factor:g}",
        "corrupt": ":bits=2",
    }
    fault_type, option = SHAPES.get(kind, (kind, options.get(kind, "")))
    spacing = PERSISTENT_SPACING_STEPS if fault_type in PERSISTENT else FAULT_SPACING_STEPS
    for _ in range(trials):
        at = step + rng.randint(0, 9)
        items.append(f"{fault_type}@step={at}:rank={rng.randrange(nodes)}{option}")
        step += spacing
    return ",".join(items), step + 15


def score(kind: str, events: list[dict], step_s: float | None) -> dict:
    faults = [e for e in events if e["kind"] == "fault"]
    detected_by = DETECTORS[SHAPES[kind][0] if kind in SHAPES else kind]
    anomalies = [e for e in events if e["kind"] == "anomaly" and e.get("type") in detected_by]
    if kind == "crash":
        verdicts = [e for e in events if e["kind"] == "diagnosis"]
        blamed = lambda v: v.get("blamed", [])  # noqa: E731
    else:
        verdicts = [e for e in events if e["kind"] == "decision"]
        blamed = lambda v: v.get("nodes", [])  # noqa: E731
    latencies, latency_steps, right, detected = [], [], 0, 0
    answered: set[int] = set()
    trials: list[dict] = []  # one per fault: where it was, when and whom it was found on
    persistent = (SHAPES[kind][0] if kind in SHAPES else kind) in PERSISTENT
    restarts = [e["time"] for e in events if e["kind"] == "generation"]
    for i, f in enumerate(faults):
        trial = {"node": f.get("node"), "step": f.get("step"), "found": False}
        trials.append(trial)
        # Earlier slowdowns of another node still going on (no new generation since): this
        # trial's job has two slowed nodes, scored apart.
        overlapped = sorted(
            {
                g["node"]
                for g in faults[:i]
                if persistent
                and g.get("node") != f.get("node")
                and not any(g["time"] < t < f["time"] for t in restarts)
            }
        )
        if overlapped:
            trial["overlapped"] = overlapped
        end = faults[i + 1]["time"] if i + 1 < len(faults) else f["time"] + DETECTION_WINDOW_S
        hits = [
            a
            for a in anomalies
            if f["time"] - 0.5 <= a["time"] <= min(end, f["time"] + DETECTION_WINDOW_S)
        ]
        if not hits:
            continue
        latency = max(0.0, hits[0]["time"] - f["time"])
        trial.update(found=True, anomaly_nodes=hits[0].get("nodes"), latency_s=round(latency, 2))
        if kind in SLOWED and hits[0].get("step") is not None and f.get("step") is not None:
            trial["latency_steps"] = hits[0]["step"] - f["step"]
        verdict = next(
            (
                j
                for j, v in enumerate(verdicts)
                if j not in answered
                and v["time"] >= hits[0]["time"] - 0.5
                and v["time"] <= min(end, f["time"] + DETECTION_WINDOW_S)
            ),
            None,
        )
        if verdict is not None:
            answered.add(verdict)  # it answers a fault, whichever of the slowed nodes it names
            trial["blamed"] = blamed(verdicts[verdict])
        if overlapped:
            continue
        detected += 1
        latencies.append(latency)
        if "latency_steps" in trial:
            latency_steps.append(trial["latency_steps"])
        if kind == "nan" or trial.get("blamed") == [f["node"]]:
            right += verdict is not None
        if kind == "corrupt" and not hits[0].get("nodes"):  # 2 replicas: the replay names it
            replays = [a for a in hits[1:] if a.get("severity") == "info"]
            if replays:
                trial["replay_named"] = replays[0].get("nodes", [])
    clean = len(faults) - sum("overlapped" in t for t in trials)
    replayed = [t for t in trials if "replay_named" in t]
    out = {
        "faults": len(faults),
        "overlapped": len(faults) - clean,
        "detected": detected,
        "recall": detected / clean if clean else None,
        "precision": len(answered) / len(verdicts) if verdicts else None,
        "attribution": right / detected if detected else None,
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p95_s": percentile(latencies, 0.95),
        "latency_max_s": max(latencies) if latencies else None,
        "median_step_s": step_s,
    }
    if replayed:  # a split without a majority, then its replay (transom.monitor.replicas)
        out["replays"] = len(replayed)
        out["replay_right_node"] = sum(t["replay_named"] == [t["node"]] for t in replayed)
        out["replay_wrong_node"] = sum(
            bool(t["replay_named"]) and t["replay_named"] != [t["node"]] for t in replayed
        )
    if latency_steps:
        out["latency_p50_steps"] = percentile(latency_steps, 0.5)
        out["latency_max_steps"] = max(latency_steps)
        within = sum(s <= TARGETS["slow_steps"] for s in latency_steps)
        out["within_target_steps"] = within / clean if clean else None
    if step_s and latencies:  # the measure: within 30 x the median step time
        within_s = sum(s <= TARGETS["slow_steps"] * step_s for s in latencies)
        out["within_target_s"] = within_s / clean if clean else None
        in_median_steps = [s / step_s for s in latencies]
        out["latency_p50_median_steps"] = percentile(in_median_steps, 0.5)
        out["latency_max_median_steps"] = max(in_median_steps)
        for trial in trials:
            if "latency_s" in trial:
                trial["latency_median_steps"] = round(trial["latency_s"] / step_s, 1)
    out["trials"] = trials
    return out


def fault_free(
    tmp: Path,
    minutes: float,
    nodes: int = NODES,
    workload: Workload = WORKLOADS["gpt"],
    step_delay_s: float = STEP_DELAY_S,
    log_level: str = "warning",
) -> dict:
    """A job without faults, with checkpoints (and for train_gpt an evaluation pass every 100
    steps), sized to last at least `minutes` (at `log_level` debug its controllers log every
    straggler evaluation)."""
    steps = max(60, int(minutes * 60 / workload.fault_free_step_s))
    t0 = time.time()
    events = run_job(
        tmp / "fault-free",
        None,
        0,
        steps,
        True,
        nodes,
        step_delay_s,
        log_level,
        timeout_s=2 * minutes * 60 + JOB_TIMEOUT_S,
        workload=workload,
    )
    hours = (time.time() - t0) / 3600
    false = [
        e
        for e in events
        if (e["kind"] == "anomaly" and e.get("severity") != "info")
        or e["kind"] in ("decision", "warning", "incident")
    ]
    return {
        "duration_s": round(hours * 3600, 1),
        "steps": steps,
        "finished": any(e["kind"] == "succeeded" for e in events),
        "false_positives": len(false),
        "false_positives_per_hour": len(false) / hours if hours else None,
        "examples": [e["message"][:120] for e in false[:5]],
    }


def pattern_scores(corpus: Path = LOG_CORPUS) -> dict:
    """Precision and recall of the log classifier's hardware classifications on the corpora.

    benign.txt holds harmless lines, hardware.txt "<type>\t<line>" real-format error lines. A
    true positive is a line labelled with a hardware type and classified as exactly that type;
    a false positive is any other line classified as hardware (benign, or of another type).
    """
    benign = [line for line in (corpus / "benign.txt").read_text().splitlines() if line]
    labelled = [
        tuple(row.split("\t", 1)) for row in (corpus / "hardware.txt").read_text().splitlines()
    ]
    true_pos = false_pos = right_type = benign_alerts = 0
    for label, line in [("", line) for line in benign] + labelled:
        found = patterns.classify(line)
        right = found is not None and found.type == label
        right_type += right and bool(label)
        benign_alerts += not label and found is not None and found.severity != "info"
        if found is not None and found.hardware:
            true_pos += right
            false_pos += not right
    positives = sum(label in anomaly_types.HARDWARE for label, _ in labelled)
    return {
        "benign_lines": len(benign),
        "hardware_corpus_lines": len(labelled),
        "hardware_lines": positives,
        "true_positives": true_pos,
        "false_positives": false_pos,
        "benign_alerts": benign_alerts,  # benign lines raised above info severity, of any type
        "patterns_precision_x": true_pos / (true_pos + false_pos) if true_pos + false_pos else None,
        "patterns_recall_x": true_pos / positives if positives else None,
        "type_accuracy_x": right_type / len(labelled) if labelled else None,
    }


def keep_runs(keep_dir: Path, label: str, dirs: list[Path]) -> None:
    """Copy the run directories `dirs` (their events and logs, not their checkpoints) into a
    new folder of `keep_dir` named after `label` and the time."""
    keep = keep_dir / f"{label}-{int(time.time())}"
    keep.mkdir(parents=True, exist_ok=True)
    for d in dirs:
        shutil.copytree(d, keep / d.name, ignore=shutil.ignore_patterns("checkpoints"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.detection",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--trials",
        type=int,
        default=20,
        help="faults per type, all in one job per type (default 20)",
    )
    p.add_argument(
        "--script",
        choices=tuple(WORKLOADS),
        default="gpt",
        help="the script measured: gpt (examples/train_gpt.py, Transom's monitor API; default), "
        "ddp (examples/ddp_unmodified.py) or hf (examples/hf_trainer_unmodified.py), plain "
        f"scripts with no Transom import, which take no {' or '.join(NEEDS_API)} faults",
    )
    p.add_argument(
        "--types",
        default=None,
        help=f"fault types to run (default: all of {', '.join(FAULTS)} the script takes), and "
        f"slowdown shapes: {', '.join(SHAPES)}, or 'shapes' for all four",
    )
    p.add_argument(
        "--fault-free-minutes",
        type=float,
        default=30.0,
        help="length of the fault-free job for false positives (default 30; 0 skips)",
    )
    p.add_argument(
        "--overhead-steps", type=int, default=300, help="steps per overhead run (default 300)"
    )
    p.add_argument(
        "--overhead-rounds",
        type=int,
        default=20,
        help="alternating on/off pairs (default 20; 0 skips; see benchmarks/monitor/overhead.py)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", type=int, default=NODES, help=f"nodes a job (default {NODES})")
    p.add_argument(
        "--step-delay",
        type=float,
        default=STEP_DELAY_S,
        help=f"the script's sleep a step (default {STEP_DELAY_S}): train_gpt's after each step, "
        "the plain scripts' data delay before it (a throttled rank stopped while it sleeps "
        "loses nothing)",
    )
    p.add_argument(
        "--throttle-factor",
        type=float,
        default=THROTTLE_FACTOR,
        help=f"a throttled rank runs 1/F of the time (default {THROTTLE_FACTOR:g})",
    )
    p.add_argument(
        "--patterns-only",
        action="store_true",
        help="only measure the log classifier on the corpora (no jobs)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument(
        "--keep-dir",
        default="",
        help="copy each job's run directory here, less its checkpoints, its controllers logging "
        "at debug level (every straggler evaluation), to study a trial",
    )
    args = p.parse_args(argv)
    workload = WORKLOADS[args.script]
    if args.types is None:
        args.types = ",".join(t for t in FAULTS if t in supported(workload))
    unknown = set(args.types.split(",")) - {"", "shapes", *FAULTS, *SHAPES}
    if unknown:
        p.error(f"--types: unknown {', '.join(sorted(unknown))}")
    refused = sorted(set(args.types.split(",")) - {"", "shapes", *supported(workload)})
    if refused:  # one line, no usage: the options parsed, the combination is refused
        print(
            f"{p.prog}: error: --types {','.join(refused)} needs Transom's monitor API, through "
            f"which the worker applies it; --script {workload.name} runs a plain script without "
            "it (use --script gpt)",
            file=sys.stderr,
        )
        return 2
    rng = random.Random(args.seed)
    result: dict = {
        "script": workload.name,
        "script_path": str(workload.path.relative_to(REPO)),
        "transom": {},
        "trials": args.trials,
        "seed": args.seed,
        "targets": TARGETS,
    }
    result["patterns"] = pattern_scores()
    result["patterns_precision_x"] = result["patterns"]["patterns_precision_x"]
    result["patterns_recall_x"] = result["patterns"]["patterns_recall_x"]
    print(f"patterns: {json.dumps(result['patterns'])}", flush=True)
    if args.patterns_only:
        args.types, args.fault_free_minutes, args.overhead_rounds = "", 0, 0
    if args.overhead_rounds > 0 and not workload.api:
        print(
            f"overhead: not measured for --script {workload.name} (train_gpt's own; an unmodified "
            "loop's is `python -m benchmarks.monitor.overhead --auto`)",
            flush=True,
        )
        args.overhead_rounds = 0
    with tempfile.TemporaryDirectory(prefix="transom-detection-") as tmp_name:
        tmp = Path(tmp_name)
        log_level = "debug" if args.keep_dir else "warning"  # debug: every straggler evaluation
        kinds = [t for t in args.types.split(",") if t]
        if "shapes" in kinds:
            kinds[kinds.index("shapes") : kinds.index("shapes") + 1] = list(SHAPES)
        for kind in kinds:
            # Evictions use up spares, and a job has at most as many spares as nodes: several jobs.
            per_job = args.nodes if kind in EVICTING else args.trials
            t0, events, dirs, slowed = time.time(), [], [], []
            for i in range(0, args.trials, per_job):
                n = min(per_job, args.trials - i)
                spec, steps = schedule(kind, n, rng, args.nodes, args.throttle_factor)
                dirs.append(tmp / f"{kind}{i}")
                spares = n if kind in EVICTING else 0
                job = run_job(
                    dirs[-1],
                    spec,
                    spares,
                    steps,
                    False,
                    args.nodes,
                    args.step_delay,
                    log_level,
                    workload=workload,
                )
                events += job
                slowed += slowdowns(dirs[-1], job, workload.log_step_offset)
            result["transom"][kind] = score(kind, events, median_step_s(dirs))
            result["transom"][kind]["job_s"] = round(time.time() - t0, 1)
            result["transom"][kind]["nodes"] = args.nodes
            result["transom"][kind]["script"] = workload.name
            if (kind == "throttle" or kind in SHAPES) and slowed:
                result["transom"][kind]["job_slowdown_p50_x"] = statistics.median(slowed)
                result["transom"][kind]["job_slowdowns_x"] = slowed
                if kind == "throttle":
                    result["transom"][kind]["throttle_factor"] = args.throttle_factor
                else:
                    result["transom"][kind]["fault"] = "".join(SHAPES[kind])
            print(f"{kind}: {json.dumps(result['transom'][kind])}", flush=True)
            if args.keep_dir:
                keep_runs(Path(args.keep_dir), f"{kind}-{workload.name}-{args.nodes}n", dirs)
        if args.fault_free_minutes > 0:
            result["fault_free"] = fault_free(
                tmp,
                args.fault_free_minutes,
                args.nodes,
                workload,
                args.step_delay,
                log_level,
            )
            if args.keep_dir:
                label = f"fault-free-{workload.name}-{args.nodes}n"
                keep_runs(Path(args.keep_dir), label, [tmp / "fault-free"])
            result["fault_free"]["script"] = workload.name
            print(f"fault-free: {json.dumps(result['fault_free'])}", flush=True)
        if args.overhead_rounds > 0:
            result["overhead"] = measure_overhead(tmp, args.overhead_rounds, args.overhead_steps)
            print(f"overhead: {json.dumps(result['overhead'])}", flush=True)
    print_table(result)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
