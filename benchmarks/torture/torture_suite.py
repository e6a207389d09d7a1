"""Torture suite: real faults in Transom's own control plane, and what each cost a real job.

Each scenario (scenarios.py) trains examples/train_gpt.py with the checkpoint engine on
3 nodes + 1 spare, injects its fault once training passed step 8, lets the job finish and
measures (measure.py): did it succeed, restarts, evictions, steps trained twice, wrong
checkpoint loads, final weights bit-identical to a fault-free torchrun run of the same training,
and processes or /dev/shm entries the job left behind. Every row is checked against what issue
11 asks of the scenario ("meets" column; the JSON lists each unmet expectation).

    python -m benchmarks.torture                              # every scenario, 1 trial each
    python -m benchmarks.torture --json --trials 3 --scenario etcd_stop_2s agent_sigkill
    python -m benchmarks.torture --scenario worker_kill_ckpt --trials 34 --kills 3  # ~100 moments
    python -m benchmarks.torture --scenario kill_mixed --trials 18 --kills 6  # issue 13: 108 kills
    python -m benchmarks.torture --lock /work/wt/e2e.lock     # hold a lock file per trial only
    python -m benchmarks.torture --markdown a.json b.json      # the README table of --json runs

With --json the last line printed is one JSON object: {"scenarios": [...]} with every trial's
row. Run directories stay under --work (default a new temporary directory) for inspection.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.torture.job import CKPT_EVERY, LocalJob, ProxiedJob, reference_weights  # noqa: E402
from benchmarks.torture.kills import KILL_SCENARIOS, VICTIMS  # noqa: E402
from benchmarks.torture.measure import measure  # noqa: E402
from benchmarks.torture.scenarios import SCENARIOS as BASE_SCENARIOS  # noqa: E402
from benchmarks.torture.scenarios import Scenario, check  # noqa: E402

SCENARIOS = [*BASE_SCENARIOS, *KILL_SCENARIOS]
BY_NAME = {s.name: s for s in SCENARIOS}


@contextlib.contextmanager
def held(lock: Path | None):
    """The lock file held (flock) for the duration, when one is given."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_trial(
    scenario: Scenario,
    work: Path,
    seed: int,
    rng: random.Random,
    kills: int,
    lock: Path | None,
    ckpt_every: int = CKPT_EVERY,
) -> dict:
    with held(lock):
        reference = reference_weights(work, scenario.steps, seed)
        return _trial(scenario, work, seed, rng, kills, reference, ckpt_every)


def _trial(
    scenario: Scenario,
    work: Path,
    seed: int,
    rng: random.Random,
    kills: int,
    reference: Path,
    ckpt_every: int = CKPT_EVERY,
) -> dict:
    job = (LocalJob if scenario.kind == "local" else ProxiedJob)(
        work, scenario.steps, seed, scenario.options, ckpt_every
    )
    job.kills = kills
    extra: dict = {}
    error = None
    succeeded = False
    leftovers: dict = {"processes": [], "shm": []}
    try:
        job.start()
        job.watch()
        job.wait_for_step(scenario.fault_step)
        extra = scenario.fault(job, rng)
        if job.wait(scenario.timeout_s):
            succeeded = job.succeeded()
            leftovers = job.leftovers()
        else:
            error = f"the job did not end within {scenario.timeout_s:.0f} s of its fault"
    except Exception as e:  # noqa: BLE001 - a trial that breaks is a row that says why
        error = f"{type(e).__name__}: {e}"
    finally:
        job.unwatch()
        job.stop()
    try:
        row = measure(job, reference, succeeded, leftovers)
        if scenario.measures is not None:
            extra |= scenario.measures(job)
    finally:
        job.cleanup()
        if isinstance(job, ProxiedJob):
            job.close()
    row["leftovers"] = len(row["leftover_procs"]) + len(row["leftover_shm"])
    row |= extra
    row["error"] = error
    row["unmet"] = check(scenario, row) + ([f"error: {error}"] if error else [])
    row["meets"] = not row["unmet"]
    return row


def summary(scenario: Scenario, rows: list[dict]) -> dict:
    def values(name: str) -> list:
        return [r.get(name) for r in rows]

    phases: dict[str, dict[str, int]] = {}  # the kill scenarios': victim -> phase -> kills
    for r in rows:
        for victim, counts in (r.get("phases") or {}).items():
            for phase, n in counts.items():
                phases.setdefault(victim, {})[phase] = phases.get(victim, {}).get(phase, 0) + n
    return {
        "scenario": scenario.name,
        "what": scenario.what,
        "trials": len(rows),
        "kills": sum(r.get("kills") or 0 for r in rows),
        "phases": phases,
        "succeeded": sum(bool(r["succeeded"]) for r in rows),
        "restarts": values("restarts"),
        "evictions": values("evictions"),
        "steps_lost": values("steps_lost"),
        "wrong_loads": sum(r["wrong_loads"] or 0 for r in rows),
        "identical": sum(r["identical"] is True for r in rows),
        "left_behind": sum(r["leftovers"] for r in rows),
        "meets": sum(r["meets"] for r in rows),
        "rows": rows,
    }


def table(results: list[dict]) -> Table:
    t = Table(title="Transom torture suite")
    for column in (
        "scenario", "trials", "succeeded", "restarts", "evictions", "steps lost",
        "wrong loads", "weights identical", "left behind", "meets issue 11",
    ):  # fmt: skip
        t.add_column(column)
    for s in results:
        n = s["trials"]
        t.add_row(
            s["scenario"], str(n), f"{s['succeeded']}/{n}", _list(s["restarts"]),
            _list(s["evictions"]), _list(s["steps_lost"]), str(s["wrong_loads"]),
            f"{s['identical']}/{n}", str(s["left_behind"]), f"{s['meets']}/{n}",
        )  # fmt: skip
    return t


def markdown(results: list[dict]) -> str:
    """The table as README markdown."""
    lines = [
        "| scenario | trials | succeeded | restarts | evictions | steps lost | wrong loads "
        "| weights identical | left behind | meets issue 11 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in results:
        n = s["trials"]
        lines.append(
            f"| `{s['scenario']}` | {n} | {s['succeeded']}/{n} | {_list(s['restarts'])} "
            f"| {_list(s['evictions'])} | {_list(s['steps_lost'])} | {s['wrong_loads']} "
            f"| {s['identical']}/{n} | {s['left_behind']} | {s['meets']}/{n} |"
        )
    return "\n".join(lines)


def kills_line(phases: dict[str, dict[str, int]]) -> str:
    """Kills per victim kind and the phase each landed in, in words."""
    parts = []
    for victim in VICTIMS:
        counts = phases.get(victim) or {}
        if counts:
            where = ", ".join(f"{n} {phase}" for phase, n in sorted(counts.items()))
            parts.append(f"{victim} {sum(counts.values())} ({where})")
    return "; ".join(parts) or "none"


def _list(values: list) -> str:
    """Each trial's value; for many trials their sum and range (a table cell stays short)."""
    known = [v for v in values if v is not None]
    if len(values) > 5 and known:
        return f"{sum(known)} ({min(known)}-{max(known)} a trial)"
    return ",".join("?" if v is None else str(v) for v in values)


def _last_json(path: Path) -> dict:
    return json.loads(path.read_text().strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.torture",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument(
        "--markdown",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="only print the README table of earlier --json outputs (files), and exit",
    )
    parser.add_argument("--trials", type=int, default=1, help="trials of each scenario")
    parser.add_argument(
        "--scenario", nargs="+", choices=list(BY_NAME), help="only these (default: all)"
    )
    parser.add_argument(
        "--kills", type=int, default=2, help="*_kill_*: SIGKILLs per trial (default 2)"
    )
    parser.add_argument(
        "--ckpt-every",
        type=int,
        default=CKPT_EVERY,
        metavar="K",
        help=f"the job checkpoints every K steps (default {CKPT_EVERY}; 1: a snapshot every "
        "step, storage every 20th, as train_gpt.py does by default)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the training and the faults")
    parser.add_argument("--work", type=Path, help="where run directories go (default: a temp dir)")
    parser.add_argument("--lock", type=Path, help="a lock file to hold (flock) for each trial")
    args = parser.parse_args()
    if args.markdown:
        results = [s for path in args.markdown for s in _last_json(path)["scenarios"]]
        print(markdown(results))
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="transom-torture-"))
    work.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=args.json, width=160)
    console.print(f"run directories: {work}")
    rng = random.Random(args.seed)
    results = []
    for scenario in [BY_NAME[n] for n in args.scenario] if args.scenario else SCENARIOS:
        rows = []
        for trial in range(args.trials):
            started = time.monotonic()
            row = run_trial(scenario, work, args.seed, rng, args.kills, args.lock, args.ckpt_every)
            rows.append(row)
            console.print(
                f"{scenario.name} trial {trial + 1}/{args.trials}: "
                f"{'meets issue 11' if row['meets'] else 'UNMET: ' + '; '.join(row['unmet'])} "
                f"({row['seconds']:.0f} s from the job's start to its end, "
                f"{time.monotonic() - started:.0f} s with the lock wait and the reference; "
                f"{work / row['job_id']})",
                highlight=False,
                markup=False,
            )
        results.append(summary(scenario, rows))
    console.print(table(results))
    for s in results:
        if s["kills"]:
            console.print(f"{s['scenario']}: {s['kills']} kills; " + kills_line(s["phases"]))
    if args.json:
        print(json.dumps({"work": str(work), "scenarios": results}))
    return 0 if all(s["meets"] == s["trials"] for s in results) else 1


if __name__ == "__main__":
    sys.exit(main())
