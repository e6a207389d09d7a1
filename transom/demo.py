"""`transom demo`: the example GPT through a seeded campaign of real faults, then the proof.

What a new user runs first. It trains the packaged example GPT (transom/workloads/train_gpt.py,
which examples/train_gpt.py runs) on DEMO_NODES simulated nodes plus
DEMO_SPARES hot spare under `transom run` (live view), while a fault campaign hits it: a worker
SIGKILLed, a node's agent SIGKILLed (a node death), a worker SIGSTOPped (a hang), a silent bit
flip in one rank's parameters (found by the replicas' fingerprints, taken every
DEMO_FINGERPRINT_EVERY steps), a NaN loss and a node made several times slower, one after
another, spread over the run. The launcher plays the
cluster's scheduler (`refill_spares`): each evicted node is replaced by a new one, so a spare is
ready for the next fault. Then it trains the same model, seed and world size once more without
faults, under plain torchrun (the reference), and writes the report (`transom.report`): the
timeline picture, goodput, per-fault detection and recovery times, and whether the final
weights of the two runs are bit-identical.

Exit code 0 only when the job succeeded, every fault was detected and recovered from, and the
weights are identical; 1 otherwise (the reason on stderr); 130 on Ctrl-C. The reference run's
progress and fresh start are read from the trainer's JSON result files (--result-dir), never
from its log text; the faults are described by their types (transom.faults).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from transom.common import env
from transom.faults import DETECTORS, FAULT_TYPES, parse_schedule
from transom.job_spec import ConfigError, JobSpec, new_job_id, prepare_run_dir
from transom.launcher import Launch, Launcher
from transom.report.rundir import FINAL_WEIGHTS_FILE, REFERENCE_FILE, REFERENCE_WEIGHTS_FILE
from transom.utils.procs import die_with_parent, stop_process
from transom.workloads import script_path
from transom.workloads.results import read_results

DEMO_NODES = 4
DEMO_SPARES = 1
DEMO_STEPS = 480
MIN_STEPS = 80
DEMO_MAX_RESTARTS = 10
SLOW_FACTOR = 3
CORRUPT_BITS = 4
# Replica fingerprints every few steps (transom.monitor.fingerprint): a corruption is found
# within this many steps. A fingerprint of the demo's model costs about 0.2 ms against a step of
# 15 ms or more (python -m benchmarks.fingerprint_cost); an operator's own
# TRANSOM_FINGERPRINT_EVERY wins.
DEMO_FINGERPRINT_EVERY = 5
# A corruption rolls back to the last step whose fingerprints agreed, a fingerprint interval and
# the detection's second or so back: further than memory's two newest steps. Storage gets every
# DEMO_FINGERPRINT_EVERY-th step (train_gpt's --persist-every) and keeps DEMO_CKPT_KEEP of them,
# so that step is there (without it the rollback would go back to train_gpt's 20-step default).
DEMO_CKPT_KEEP = 6
# (fault, where in the run as a fraction of the steps, its target): one of each, spread out so
# that the node which replaces an evicted one (a new node takes about 5 s to join as a spare
# here) is ready before the next fault needs it: the faults that evict (kill, hang, corrupt,
# slow) are at least 0.12 of the run apart, and a corruption found before the spare is back is
# rolled back without an eviction. The nan and the crash need no spare.
CAMPAIGN = (
    ("crash", 0.125, "rank=1"),
    ("kill", 0.29, "rank=3"),
    ("hang", 0.46, "rank=2"),
    ("corrupt", 0.58, f"rank=1:bits={CORRUPT_BITS}"),
    ("nan", 0.68, "rank=0"),
    ("slow", 0.81, f"rank=1:factor={SLOW_FACTOR}"),
)
REFERENCE_RESULTS = "results"  # under run_dir/reference: the reference ranks' result files


class ReferenceRunError(RuntimeError):
    """The fault-free reference run failed: the weights cannot be checked."""


def example_script() -> Path:
    """The packaged example trainer (transom/workloads/train_gpt.py), installed or not."""
    script = script_path("train_gpt")
    if not script.is_file():
        raise ConfigError(f"the demo needs {script}, which is missing from this installation")
    return script


def campaign(steps: int) -> str:
    """The demo's fault schedule for a run of `steps` steps."""
    return ",".join(
        f"{kind}@step={max(1, round(at * steps))}:{target}" for kind, at, target in CAMPAIGN
    )


def train_args(steps: int, seed: int, weights: Path) -> list[str]:
    return [
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--save-final",
        str(weights),
        "--log-every",
        "10",
    ]


def run_reference(
    run_dir: Path, script: Path, steps: int, seed: int, world_size: int, console: Console
) -> dict:
    """Train the same model without faults under torchrun; returns what reference.json holds."""
    # its own, empty checkpoint directory: it must start from scratch
    workdir = run_dir / "reference"
    results = workdir / REFERENCE_RESULTS
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(world_size),
        str(script),
        *train_args(steps, seed, run_dir / REFERENCE_WEIGHTS_FILE),
        "--ckpt-every",
        "0",
        "--ckpt-dir",
        str(workdir / "checkpoints"),
        "--result-dir",
        str(results),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSOM_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    log_path = run_dir / "logs" / "reference.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir()
    start = time.time()
    columns = (
        TextColumn("fault-free reference (torchrun)"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with open(log_path, "wb") as out, Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("reference", total=steps)
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=workdir,
            preexec_fn=die_with_parent,
        )
        try:
            while process.poll() is None:
                time.sleep(0.5)
                done = [r.get("step") or 0 for r in read_results(results).values()]
                bar.update(task, completed=max(done, default=0))
        finally:
            stop_process(process)
    ranks = read_results(results)
    if process.returncode != 0:
        raise ReferenceRunError(
            f"the fault-free reference run failed (exit code {process.returncode}); see {log_path}"
        )
    if sorted(ranks) != list(range(world_size)) or any(
        r.get("resumed_step") != 0 or not r.get("done") for r in ranks.values()
    ):
        raise ReferenceRunError(
            f"the fault-free reference run did not start from scratch on every rank; see {log_path}"
        )
    return {"wall_s": round(time.time() - start, 3), "steps": steps, "command": command}


def intro(spec: JobSpec, steps: int, run_dir: Path, fingerprint_every: str) -> Panel:
    faults = "\n".join(
        f"  step {f.step:>4}: {f.type:<7} "
        + FAULT_TYPES[f.type].describe(f)
        + f"  (rank {f.rank}; found by: {', '.join(DETECTORS[f.type])})"
        for f in spec.faults
    )
    return Panel(
        f"Training a small GPT for {steps} steps on {spec.nnodes_max} simulated nodes + "
        f"{spec.spares} hot spare ({spec.world_size} ranks, gloo on CPU), with these faults:\n"
        f"{faults}\nReplica fingerprints every {fingerprint_every} steps. "
        "Nobody intervenes: Transom detects each fault, names the node to blame, evicts "
        f"it (a new node refills the spare pool), and resumes from the newest checkpoint in "
        f"memory.\nThen the same training without faults (torchrun), and the report.\n"
        f"Run directory: {run_dir}",
        title="transom demo",
        expand=False,
    )


def run_demo(
    steps: int = DEMO_STEPS,
    seed: int = 0,
    run_dir: str | os.PathLike | None = None,
    reference: bool = True,
    job_id: str | None = None,
    console: Console | None = None,
) -> int:
    if steps < MIN_STEPS:
        raise ConfigError(
            f"--steps {steps}: the demo needs at least {MIN_STEPS} steps to space its faults"
        )
    from transom.report import write_report  # matplotlib: imported only when needed

    console = console or Console(soft_wrap=True)
    script = example_script()
    job_id = job_id or "demo-" + new_job_id().split("-")[1]
    run_path = prepare_run_dir(run_dir or Path("transom-runs") / job_id)
    spec = JobSpec(
        script=str(script),
        script_args=[
            *train_args(steps, seed, run_path / FINAL_WEIGHTS_FILE),
            *("--persist-every", str(DEMO_FINGERPRINT_EVERY)),
        ],
        job_id=job_id,
        nnodes_min=DEMO_NODES,
        nnodes_max=DEMO_NODES,
        spares=DEMO_SPARES,
        max_restarts=DEMO_MAX_RESTARTS,
        faults=parse_schedule(campaign(steps), DEMO_NODES, seed),
        ckpt_keep=DEMO_CKPT_KEEP,
    ).validate()
    # The agents this launcher starts, and so the workers, inherit it.
    every = os.environ.setdefault(env.FINGERPRINT_EVERY, str(DEMO_FINGERPRINT_EVERY))
    console.print(intro(spec, steps, run_path, every))
    code = Launcher(
        Launch(spec=spec, run_dir=run_path, refill_spares=True, total_steps=steps), console=console
    ).run()
    if code == 130:
        return code
    problems = []
    if code == 0 and reference:
        try:
            info = run_reference(run_path, script, steps, seed, spec.world_size, console)
            (run_path / REFERENCE_FILE).write_text(json.dumps(info, indent=1))
        except ReferenceRunError as e:
            problems.append(str(e))
    summary = write_report(run_path)
    console.rule("report")
    console.print(summary["text"], highlight=False, markup=False)
    console.print(f"written: {run_path / 'report.png'}, report.md, report.json", style="dim")
    problems += verdict(summary, code, reference and not problems)
    for problem in problems:
        print(f"transom demo: {problem}", file=sys.stderr)
    return 1 if problems else 0


def verdict(summary: dict, code: int, reference: bool) -> list[str]:
    """What keeps the demo from being a success (empty: every claim holds)."""
    problems = []
    if code != 0:
        problems.append(f"the job did not succeed: {summary.get('outcome', {}).get('reason')}")
    for fault in summary.get("faults", []):
        if fault.get("status") != "detected+recovered":
            problems.append(
                f"fault {fault.get('type')} at step {fault.get('step')}: {fault.get('status')}"
            )
    weights = summary.get("weights") or {}
    if reference and code == 0 and not weights.get("identical"):
        problems.append(f"final weights differ from the fault-free run: {weights.get('summary')}")
    return problems
