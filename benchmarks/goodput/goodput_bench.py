"""Goodput benchmark: one training job and one fault schedule under Transom and under torchrun.

The same script (examples/train_gpt.py), steps and faults run under (each checkpointing as it
would: Transom a memory snapshot every step, --transom-ckpt-every; torchrun a file every K steps,
--ckpt-every)
  transom   `transom run --nnodes 4 --spares 1 --refill-spares --max-restarts 10 --faults
            SCHEDULE`, checkpoints with transom.checkpoint (node memory, replicated, persisted in
            the background);
  torchrun  what a user would pick today: 4 torchrun agents on this machine (`--nnodes 4
            --rdzv-backend c10d`, rendezvous hosted by node0's agent, `--max-restarts 10`),
            torch.save checkpoints, a collective timeout (--collective-timeout, default 60 s;
            torch's defaults are 10 min for NCCL and 30 min for gloo, so this favours the
            baseline) and a loss check that raises on NaN (train_gpt.py --fail-on-nan), so
            torchrun restarts the job.
and, unless --no-reference, a fault-free torchrun run (`floor`) whose final weights both runs
must match.

Faults under torchrun are injected by this benchmark, of the same type at the same step: it listens
to the workers' monitor datagrams (transom.monitor.reporter, pointed at its own monitor socket) to
see each rank's steps, and
  crash  SIGKILLs the rank's worker;
  kill   SIGKILLs the node's torchrun agent and its worker, and starts a replacement agent at once
         (a hot spare, which favours the baseline);
  hang   SIGSTOPs the rank's worker (its peers block until the collective timeout);
  slow, nan  are applied inside the worker by the reporter (TRANSOM_FAULTS), once: a restarted
         worker gets the same environment, so each fault carries a once_file.

Measured for each system, from rank 0's progress lines (`step N loss X t=...`):
  wall_s       launch -> step N done
  ettr_x       effective training time ratio: time computing the steps that are in the final model
               (the last run of each step) / wall_s
               (a system with slower steps scores higher on it: read it with step_s)
  goodput_x    the fault-free run's wall_s / wall_s: the share of the wall time a fault-free
               torchrun job would have needed (with --no-reference: not measured)
  lost_steps   steps computed and then thrown away (rolled back or redone after a restart)
  step_s       the normal pace: the median step time before the first fault
  startup_s    launch -> step 1 done
  cost_s       per fault: injection -> the job is back at the step it had reached, minus the time
               the steps it completed in between take at the normal pace (step_s); for slow: the
               time from the injection to the next fault (or the end) over the normal pace.
Headline: sooner_x = (torchrun wall_s - transom wall_s) / torchrun wall_s (target >= 0.28, aim 0.5).

    python -m benchmarks.goodput                 # a table (takes ~6 minutes a trial on 2 cores)
    python -m benchmarks.goodput --json          # the table, then one JSON object on the last line
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.goodput.common import (  # noqa: E402
    BASELINE_FAULTS,
    CKPT_EVERY,
    COLLECTIVE_TIMEOUT_S,
    DEFAULT_FAULTS,
    MAX_RESTARTS,
    NODES,
    POLL_S,
    RUN_TIMEOUT_S,
    STEPS,
    TARGET_SOONER,
    TRANSOM_CKPT_EVERY,
    TRANSOM_SPARES,
    compare_weights,
    measure,
    say,
    script_args,
    show_progress,
    worker_env,
)
from benchmarks.goodput.torchrun import TorchrunJob  # noqa: E402
from transom.faults import parse_schedule  # noqa: E402
from transom.job_spec import ConfigError  # noqa: E402
from transom.testing.jobs import Line, finish, parse, transom_run

# -- the fault-free reference ----------------------------------------------------------------------


def run_reference(args, work: Path) -> dict:
    final = work / "reference.pt"
    out_path = work / "reference.out"
    say(f"floor: fault-free torchrun run of {args.steps} steps ...")
    with open(out_path, "wb") as out:
        launched = time.time()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nnodes",
                "1",
                "--nproc-per-node",
                str(NODES),
                *script_args(args, final),
                "--checkpoint",
                "torch",
                "--ckpt-dir",
                str(work / "reference-ckpt"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=worker_env(),
            start_new_session=True,
        )
        ok = finish(process, str(work / "reference-ckpt"), RUN_TIMEOUT_S)
    if not ok:
        raise RuntimeError(f"the fault-free run failed; see {out_path}")
    return measure(parse(out_path.read_text(errors="replace")), launched, args.steps, []) | {
        "final": final
    }


# -- Transom ---------------------------------------------------------------------------------


def run_transom(args, work: Path, reference: Path | None) -> dict:
    job_id = "goodput-" + uuid.uuid4().hex[:6]
    run_dir = work / job_id
    final = work / f"{job_id}-final.pt"
    say(f"transom: {args.steps} steps with faults {args.faults} ...")

    def logs() -> list[Line]:
        paths = sorted(run_dir.glob("logs/g*/rank0.log"))
        return parse("".join(p.read_text(errors="replace") for p in paths))

    seen: set[str] = set()
    last = [time.time()]
    with open(work / f"{job_id}.out", "wb") as out:
        launched = time.time()
        process = subprocess.Popen(
            transom_run(
                run_dir,
                job_id,
                "--nnodes",
                str(NODES),
                *TRANSOM_SPARES,
                "--nproc-per-node",
                "1",
                "--max-restarts",
                str(MAX_RESTARTS),
                "--faults",
                args.faults,
                *script_args(args, final, args.transom_ckpt_every),
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=worker_env(),
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while process.poll() is None and time.monotonic() < deadline:
                for e in transom_faults(run_dir):
                    if e["id"] not in seen:
                        seen.add(e["id"])
                        say(
                            f"  transom: injected {e['fault']} on {e['target']} at step {e['step']}"
                        )
                show_progress("transom", logs(), launched, args.steps, last)
                time.sleep(POLL_S)
        finally:
            ok = finish(process, job_id, timeout=0)
    if not ok:
        raise RuntimeError(f"the transom job failed (exit {process.returncode}); see {run_dir}")
    faults = transom_faults(run_dir)
    return (
        measure(logs(), launched, args.steps, faults)
        | compare_weights(final, reference)
        | {"run_dir": str(run_dir)}
    )


def transom_faults(run_dir: Path) -> list[dict]:
    try:
        text = (run_dir / "events.jsonl").read_text()
    except OSError:
        return []
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return [
        {
            "id": e["id"],
            "fault": e["fault"],
            "step": e["step"],
            "time": e["time"],
            "target": f"{e['node']} rank {e['rank']}",
        }
        for e in events
        if e.get("kind") == "fault"
    ]


# -- the report ------------------------------------------------------------------------------


def mean_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def summarize(trials: list[dict]) -> dict:
    """Means over the trials, per system and per fault."""
    out = {}
    for system in ("transom", "torchrun", "floor"):
        rows = [t[system] for t in trials if system in t]
        if not rows:
            continue
        summary = {
            k: mean_or_none(r.get(k) for r in rows)
            for k in ("wall_s", "ettr_x", "goodput_x", "lost_steps", "normal_step_s", "startup_s")
        }
        if "weights_match" in rows[0]:
            checked = rows[0]["weights_match"] is not None
            summary["weights_match"] = all(r["weights_match"] for r in rows) if checked else None
            summary["max_abs_diff"] = max(r.get("max_abs_diff", 0.0) for r in rows)
        if rows[0].get("faults"):
            summary["faults"] = [
                f | {"cost_s": mean_or_none(r["faults"][i]["cost_s"] for r in rows)}
                for i, f in enumerate(rows[0]["faults"])
            ]
        out[system] = summary
    if "transom" in out and "torchrun" in out:
        out["sooner_x"] = (out["torchrun"]["wall_s"] - out["transom"]["wall_s"]) / out["torchrun"][
            "wall_s"
        ]
        out["speedup_x"] = out["torchrun"]["wall_s"] / out["transom"]["wall_s"]
    return out


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(args, result: dict) -> None:
    print(
        f"goodput: examples/train_gpt.py on {NODES} nodes x 1 worker, {args.steps} steps, "
        f"checkpoint every {args.transom_ckpt_every} (Transom) and {args.ckpt_every} (torchrun) "
        f"steps, {args.trials} trial(s)"
    )
    print(f"faults: {args.faults}")
    print(
        f"torchrun baseline: collective timeout {args.collective_timeout:g} s (torch's defaults "
        "are 10 min for NCCL and 30 min for gloo, so the baseline is favoured); a killed node's "
        "agent is replaced at once"
    )
    print()
    print(
        f"{'system':<10}{'wall_s':>10}{'ettr_x':>9}{'goodput_x':>11}{'lost_steps':>12}{'step_s':>9}"
        f"{'startup_s':>11}  final weights vs fault-free"
    )
    for system in ("transom", "torchrun", "floor"):
        r = result.get(system)
        if r is None:
            continue
        if r.get("weights_match") is None:
            weights = "reference" if system == "floor" else "not checked"
        else:
            weights = (
                "identical"
                if r["weights_match"]
                else f"DIFFER (max abs diff {r['max_abs_diff']:.3g})"
            )
        print(
            f"{system:<10}{fmt(r['wall_s']):>10}{fmt(r['ettr_x'], '.2f'):>9}"
            f"{fmt(r['goodput_x'], '.2f'):>11}"
            f"{fmt(r['lost_steps'], '.0f'):>12}"
            f"{fmt(r['normal_step_s'], '.3f'):>9}{fmt(r['startup_s']):>11}  {weights}"
        )
    if "transom" in result and "torchrun" in result:
        print()
        print(f"{'fault':<14}{'step':>6}   {'transom cost_s':>15}{'torchrun cost_s':>17}")
        baseline = {f["id"]: f for f in result["torchrun"]["faults"]}
        for a in result["transom"]["faults"]:
            b = baseline.get(a["id"], {"cost_s": None})
            print(f"{a['fault']:<14}{a['step']:>6}   {fmt(a['cost_s']):>15}{fmt(b['cost_s']):>17}")
        print()
        sooner = result["sooner_x"]
        verdict = "meets" if sooner >= TARGET_SOONER else "MISSES"
        print(
            f"Transom finishes {sooner:.0%} sooner than torchrun "
            f"({result['speedup_x']:.2f}x faster); "
            f"{verdict} the target of {TARGET_SOONER:.0%} (aim 50%)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.goodput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})"
    )
    parser.add_argument(
        "--ckpt-every",
        type=int,
        default=CKPT_EVERY,
        metavar="K",
        help=f"torchrun's torch.save checkpoints every K steps (default {CKPT_EVERY})",
    )
    parser.add_argument(
        "--transom-ckpt-every",
        type=int,
        default=TRANSOM_CKPT_EVERY,
        metavar="K",
        help="Transom's checkpoints every K steps (default "
        f"{TRANSOM_CKPT_EVERY}: a memory snapshot every step, as train_gpt.py does under "
        f"transom run, persisted every 20th; give {CKPT_EVERY} for both alike)",
    )
    parser.add_argument(
        "--faults",
        default=DEFAULT_FAULTS,
        help=f"the fault schedule, as transom run --faults takes it (default {DEFAULT_FAULTS}); "
        f"the baseline plays {', '.join(BASELINE_FAULTS)}",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=COLLECTIVE_TIMEOUT_S,
        metavar="S",
        help=f"the torchrun baseline's collective timeout (default {COLLECTIVE_TIMEOUT_S} s)",
    )
    parser.add_argument(
        "--trials", type=int, default=1, help="runs of each system, averaged (default 1)"
    )
    parser.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the fault-free run (and with it the check of the final weights)",
    )
    parser.add_argument(
        "--work-dir",
        metavar="DIR",
        help="keep the runs (logs, run directories, weights) in DIR/trialN (default: a "
        "temporary folder, removed at the end)",
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    try:
        schedule = [f.to_dict() for f in parse_schedule(args.faults, NODES)]
    except ConfigError as e:
        parser.exit(2, f"goodput.py: {e}\n")
    unsupported = sorted({f["type"] for f in schedule} - set(BASELINE_FAULTS))
    if unsupported:
        parser.exit(
            2, f"goodput.py: the torchrun baseline cannot play {', '.join(unsupported)} faults\n"
        )
    if any(f["type"] == "kill" and f["node"] in (None, "node0") for f in schedule):
        parser.exit(
            2,
            "goodput.py: a kill fault must name a node other than node0 (node=nodeN), whose "
            "torchrun agent hosts the rendezvous\n",
        )
    if args.steps < 1 or min(args.ckpt_every, args.transom_ckpt_every, args.trials) < 1:
        parser.exit(
            2,
            "goodput.py: --steps, --ckpt-every, --transom-ckpt-every and --trials must be "
            "positive\n",
        )
    trials = []
    with tempfile.TemporaryDirectory(prefix="transom-goodput-") as tmp:
        for trial in range(args.trials):
            say(f"trial {trial + 1}/{args.trials}")
            work = Path(args.work_dir or tmp) / f"trial{trial}"
            work.mkdir(parents=True, exist_ok=False)
            row = {}
            reference = None
            if not args.no_reference:
                row["floor"] = run_reference(args, work)
                reference = row["floor"].pop("final")
            row["transom"] = run_transom(args, work, reference)
            job = TorchrunJob(args, work, schedule)
            row["torchrun"] = job.run() | compare_weights(job.final, reference)
            for system in row:
                row[system]["goodput_x"] = (
                    row["floor"]["wall_s"] / row[system]["wall_s"] if "floor" in row else None
                )
            trials.append(row)
    result = summarize(trials) | {"trials": trials}
    print_table(args, result)
    if args.json:
        print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
