"""Recovery benchmark: from a fault to the first completed training step afterwards.

Runs examples/train_gpt.py on 3 nodes (1 worker each) and injects, once training is in a steady
state (past step 12 and, under Transom, every agent's warm interpreter ready, as it is hours into
a real job):
  transom_worker_crash   SIGKILL of rank 1's worker under `transom run --nnodes 3 --spares 1
                         --refill-spares`
  transom_node_death     a machine's death: SIGKILL of node1's agent and every process it started
                         (checkpoint server, workers, warm interpreters) at once; nothing of the
                         node is left to say so: once its peers' workers have failed on it and
                         its agent stays silent (control/set_aside.py), a spare takes its place
  transom_agent_crash    SIGKILL of node1's agent alone (its workers and checkpoint server die
                         with it; the machine lives on); a spare replaces it
  torchrun_worker_crash  SIGKILL of rank 1's worker under
                         `torchrun --nproc-per-node 3 --max-restarts 3`
The transom runs checkpoint with transom.checkpoint every step, as train_gpt.py does by default (in
node memory, replicated, persisted every 20th in the background); the torchrun baseline with
torch.save files every TORCH_CKPT_EVERY steps (train_gpt.py --checkpoint torch).
and splits the time from the fault to the first step completed afterwards into
  detection_s   fault -> the controller's incident event (transom only; torchrun does not say)
  restart_s     detection (or the fault, for torchrun) -> the first new worker process started
  reload_s      new worker started -> every rank has loaded the checkpoint (imports included)
  first_step_s  checkpoint loaded -> the first step completed (process group set-up, one step)
  total_s       fault -> the first completed step
and, for the node death and the agent crash, how the spare that replaced the node restored its
rank's shard (from the checkpoint server's `restored` event of the spare's worker):
  replacement_tier    the tier it loaded from: "memory" when its server had prefetched the
                      shard from a peer ahead of it (checkpoint/prefetch.py), "peer" or "storage"
                      when the worker fetched it itself
  replacement_load_s  that load, in the worker (locate, read, checksums, rebuild)
  prefetch_s          the server's prefetch of that shard, when there was one (it overlaps the
                      worker's start-up)
A run stops as soon as that first step after the fault is done (or after a timeout: not recovered).

    python -m benchmarks.recovery            # a table
    python -m benchmarks.recovery --json     # the table, then one JSON object on the last line
    python -m benchmarks.recovery --scenarios transom_node_death --trials 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from benchmarks import REPO
from transom.testing.jobs import (
    agent_process,
    finish,
    node_processes,
    parse,
    transom_run,
    wait_for,
)

SCRIPT = REPO / "examples" / "train_gpt.py"
RUN_TIMEOUT_S = 300
# A run that has not completed a step this long after the fault counts as not recovered.
RECOVERY_TIMEOUT_S = 120
# The row of a trial with no step after its fault within RECOVERY_TIMEOUT_S.
NOT_RECOVERED = {
    "detection_s": None,
    "restart_s": None,
    "reload_s": None,
    "first_step_s": None,
    "total_s": None,
    "recovered": False,
}
FAULT_AT_STEP = 12
# After recovering from a node death or an agent crash, wait this long at most for the spare's
# `restored` event to reach the run's events.jsonl.
EVENTS_WAIT_S = 10
# Long enough that no run finishes before its fault and recovery.
STEPS = 1_000_000
TORCH_CKPT_EVERY = 5  # the torchrun baseline's torch.save interval (Transom: train_gpt's own, 1)


def split(lines: list, fault: float, detected: float | None) -> dict:
    after = [(line.what, line.t) for line in lines if line.t > fault]
    started = min(t for what, t in after if what == "start")
    resumed = max(t for what, t in after if what == "resumed")
    first_step = min(t for what, t in after if what == "step" and t > resumed)
    return {
        "detection_s": None if detected is None else detected - fault,
        "restart_s": started - (detected if detected is not None else fault),
        "reload_s": resumed - started,
        "first_step_s": first_step - resumed,
        "total_s": first_step - fault,
    }


def find_process(predicate, timeout: float = 30) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in psutil.process_iter():
            try:
                if predicate(p):
                    return p
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        time.sleep(0.05)
    raise RuntimeError("the process to inject the fault into was not found")


def wait_for_step(text_of, step: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not re.search(rf"^(?:\[\w+\]: )?step {step} ", text_of(), re.M):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job ended or stalled before step {step}")
        time.sleep(0.05)


def recovered(text_of, fault: float, process: subprocess.Popen) -> bool:
    """Wait until a training step completes after the fault (True), or the job ends or times out."""
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        lines = [(line.what, line.t) for line in parse(text_of()) if line.t > fault]
        resumed = [t for what, t in lines if what == "resumed"]
        if resumed and any(what == "step" and t > max(resumed) for what, t in lines):
            return True
        time.sleep(0.1)
    return False


def train_args(ckpt_every: int | None = None) -> list[str]:
    """train_gpt's arguments; its own checkpoint interval unless `ckpt_every` is given."""
    every = [] if ckpt_every is None else ["--ckpt-every", str(ckpt_every)]
    return [str(SCRIPT), "--steps", str(STEPS), *every, "--log-every", "1"]


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of `rank`'s worker, as its agent reports it in the run's status.json."""
    try:
        snapshot = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return None
    for status in snapshot.get("statuses", {}).values():
        pid = (status.get("pids") or {}).get(str(rank))
        if pid is not None:
            return pid
    return None


def wait_until_warm(run_dir: Path, timeout: float = 90) -> bool:
    """Steady state, as hours into a real job: whether every agent has its warm interpreter ready
    within `timeout`. A replacement imports under SCHED_IDLE (transom.control.warm), so on this
    machine, whose 2 cores the 3 ranks keep busy, it may never finish: the fault then comes
    anyway, and the row says so (`warm_ready`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            statuses = json.loads((run_dir / "status.json").read_text()).get("statuses", {})
        except (OSError, ValueError):
            statuses = {}
        if len(statuses) >= 4 and all(s.get("warm", 0) >= 1 for s in statuses.values()):
            return True
        time.sleep(0.2)
    return False


def run_transom(fault: str, work: Path) -> dict:
    job_id = "bench-" + uuid.uuid4().hex[:6]
    run_dir = work / job_id
    out = open(work / f"{job_id}.out", "wb")
    process = subprocess.Popen(
        # --refill-spares: 3 ranks share 2 cores here, so one may be evicted as a straggler
        # before the fault; a refilled spare keeps the fault's replacement possible.
        transom_run(
            run_dir, job_id, "--nnodes", "3", "--spares", "1", "--refill-spares", *train_args()
        ),
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def logs():
        return "".join(
            p.read_text(errors="replace") for p in sorted(run_dir.glob("logs/g*/rank*.log"))
        )

    try:
        wait_for_step(logs, FAULT_AT_STEP, process)
        warm_ready = wait_until_warm(run_dir)
        if fault == "worker_crash":
            victims = [find_process(lambda p: p.pid == rank_pid(run_dir, 1))]
        else:
            agent = wait_for(lambda: agent_process(job_id, "node1"), 30, "node1's agent")
            # A machine's death: its processes all at once (its warm interpreter and workers
            # too, children of the launcher's warm template), the agent last, so that none
            # outlives the agent for a moment.
            victims = node_processes(job_id, "node1") if fault == "node_death" else [agent]
        fault_time = time.time()
        for victim in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.send_signal(signal.SIGKILL)
        succeeded = recovered(logs, fault_time, process)
        # The launcher copies etcd's events to events.jsonl each tick (0.5 s): the incident may
        # not be there yet when the first step after the fault is (0.6 s after a crash).
        if succeeded:
            deadline = time.monotonic() + EVENTS_WAIT_S
            while time.monotonic() < deadline:
                events = run_events(run_dir)
                if incident_after(events, fault_time) is not None and (
                    fault == "worker_crash"
                    or replacement_load(events, fault_time)["replacement_tier"]
                ):
                    break
                time.sleep(0.2)
    finally:
        finish(process, job_id, timeout=0)
        out.close()
    if not succeeded:
        kept = Path(tempfile.mkdtemp(prefix=f"transom-recovery-failed-{job_id}-"))
        shutil.copytree(run_dir, kept / job_id, ignore=shutil.ignore_patterns("ckpt*", "*.shard"))
        shutil.copy(work / f"{job_id}.out", kept)
        print(
            f"transom job {job_id} did not recover from the {fault} within "
            f"{RECOVERY_TIMEOUT_S} s: its run directory and output are kept in {kept}",
            file=sys.stderr,
        )
        return NOT_RECOVERED | {"warm_ready": warm_ready}
    events = run_events(run_dir)
    detected = incident_after(events, fault_time)
    if detected is None:
        print(f"transom job {job_id}: no incident in its events after the {fault}", file=sys.stderr)
        return NOT_RECOVERED | {"warm_ready": warm_ready}
    row = split(parse(logs()), fault_time, detected) | {"warm_ready": warm_ready}
    if fault != "worker_crash":
        row |= replacement_load(events, fault_time)
    return row


def incident_after(events: list[dict], fault_time: float) -> float | None:
    """When the first incident after the fault began (None: none in the events yet)."""
    times = [e["time"] for e in events if e["kind"] == "incident" and e["time"] > fault_time]
    return min(times, default=None)


def run_events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def replacement_load(events: list[dict], fault: float) -> dict:
    """The tier the spare that joined after `fault` restored from, that load's duration, and its
    server's prefetch (None for what the events do not say)."""
    spares = [e.get("node") for e in events if e["kind"] == "spare" and e["time"] > fault]
    mine = [
        e
        for e in events
        if e["kind"] == "checkpoint" and e["time"] > fault and spares and e.get("node") in spares
    ]
    restored = [e for e in mine if e.get("action") == "restored"]
    prefetched = [e for e in mine if e.get("action") == "prefetched"]
    return {
        "replacement_tier": restored[0].get("tier") if restored else None,
        "replacement_load_s": restored[0].get("duration_s") if restored else None,
        "prefetch_s": prefetched[0].get("duration_s") if prefetched else None,
    }


def run_torchrun(work: Path) -> dict:
    ckpt = work / ("torchrun-" + uuid.uuid4().hex[:6])
    out_path = ckpt.with_suffix(".out")
    out = open(out_path, "wb")
    # Without this, torch 2.13's torchrun restarts reuse stale gloo addresses from the previous
    # attempt and fail or hang (pytorch issue 135712); with it torchrun recovers cleanly.
    env = {
        **os.environ,
        "TRANSOM_CHECKPOINT_DIR": str(ckpt),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "3",
            "--standalone",
            *train_args(TORCH_CKPT_EVERY),
            "--checkpoint",
            "torch",
            "--ckpt-dir",
            str(ckpt),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )

    def text():
        return out_path.read_text(errors="replace")

    try:
        wait_for_step(text, FAULT_AT_STEP, process)
        victim = find_process(
            lambda p: (
                p.environ().get("TORCHELASTIC_RUN_ID") is not None
                and p.environ().get("RANK") == "1"
                and str(ckpt) in " ".join(p.cmdline())
            )
        )
        fault_time = time.time()
        victim.send_signal(signal.SIGKILL)
        succeeded = recovered(text, fault_time, process)
    finally:
        finish(process, str(ckpt), timeout=0)
        out.close()
    try:
        return split(parse(text()), fault_time, None) | {"recovered": succeeded}
    except ValueError:  # no step after the fault: torchrun never recovered
        return NOT_RECOVERED


def mean(rows: list[dict]) -> dict:
    """Means over the trials that recovered (of the trials that have a value); `recovered`
    counts them; a text column (a tier) lists each trial's value."""
    ok = [r for r in rows if r.get("recovered", True)]
    keys = [k for k in rows[0] if k != "recovered"]
    means: dict = {}
    for k in keys:
        values = [r[k] for r in ok if r.get(k) is not None]
        if values and all(isinstance(v, str) for v in values):
            means[k] = ",".join(values)
        else:
            means[k] = statistics.mean(values) if values else None
    return means | {"recovered": len(ok)}


def cell(value) -> str:
    """A table cell: seconds to 3 decimals (a load takes milliseconds), text as is, - for none."""
    if value is None:
        return "-"
    return value if isinstance(value, str) else f"{value:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trials", type=int, default=2, help="runs per scenario, averaged (default 2)"
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    every = {
        "transom_worker_crash": lambda w: run_transom("worker_crash", w),
        "transom_node_death": lambda w: run_transom("node_death", w),
        "transom_agent_crash": lambda w: run_transom("agent_crash", w),
        "torchrun_worker_crash": lambda w: run_torchrun(w),
    }
    parser.add_argument(
        "--scenarios",
        default=",".join(every),
        help=f"comma-separated, of {', '.join(every)} (default: all)",
    )
    args = parser.parse_args()
    wanted = args.scenarios.split(",")
    unknown = set(wanted) - set(every)
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(sorted(unknown))}")
    scenarios = {name: run for name, run in every.items() if name in wanted}
    results = {}
    with tempfile.TemporaryDirectory(prefix="transom-recovery-") as tmp:
        for name, run in scenarios.items():
            rows = []
            for trial in range(args.trials):
                print(f"{name}: trial {trial + 1}/{args.trials} ...", file=sys.stderr, flush=True)
                rows.append(run(Path(tmp)))
            results[name] = mean(rows) | {"trials": args.trials}
    crash = results.get("transom_worker_crash", {}).get("total_s")
    torchrun_total = results.get("torchrun_worker_crash", {}).get("total_s")
    speedup = None if torchrun_total is None or not crash else torchrun_total / crash
    results["worker_crash_speedup_x"] = speedup
    columns = ["detection_s", "restart_s", "reload_s", "first_step_s", "total_s"]
    columns += ["replacement_tier", "replacement_load_s", "prefetch_s"]  # node death, agent crash
    print(f"{'scenario':<24}" + "".join(f"{c:>20}" for c in columns))  # means over recovered trials
    for name in scenarios:
        r = results[name]
        print(f"{name:<24}" + "".join(f"{cell(r.get(c)):>20}" for c in columns))
    for name in scenarios:
        print(f"{name}: recovered in {results[name]['recovered']} of {args.trials} trials")
    print(
        "worker crash, torchrun total / transom total: "
        + ("-" if speedup is None else f"{speedup:.2f}x")
    )
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
