"""Goodput benchmark: one training job and one fault schedule under Transom and under torchrun.

The same script (examples/train_gpt.py), steps, checkpoint interval K and faults run under
  transom   `transom run --nnodes 4 --spares 1 --refill-spares --max-restarts 10 --faults SCHEDULE`,
            checkpoints with transom.checkpoint (node memory, replicated, persisted in the background);
  torchrun  what a user would pick today: 4 torchrun agents on this machine (`--nnodes 4
            --rdzv-backend c10d`, rendezvous hosted by node0's agent, `--max-restarts 10`),
            torch.save checkpoints, a collective timeout (--collective-timeout, default 60 s; torch's
            defaults are 10 min for NCCL and 30 min for gloo, so this favours the baseline) and a
            loss check that raises on NaN (train_gpt.py --fail-on-nan), so torchrun restarts the job.
and, unless --no-reference, a fault-free torchrun run (`floor`) whose final weights both runs must match.

Faults under torchrun are injected by this benchmark, of the same type at the same step: it listens
to the workers' monitor datagrams (transom.monitor.reporter, pointed at its own UDP port) to see
each rank's steps, and
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

    python benchmarks/goodput.py                 # a table (takes ~6 minutes a trial on 2 cores)
    python benchmarks/goodput.py --json          # the table, then one JSON object on the last line
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import torch
from jobs import Line, finish, kill_marked, parse

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from transom.config import ConfigError  # noqa: E402
from transom.common import env as env_names  # noqa: E402
from transom.faults import WORKER_FAULTS, parse_schedule  # noqa: E402

SCRIPT = REPO / "examples" / "train_gpt.py"
NODES = 4
STEPS = 720
CKPT_EVERY = 20
COLLECTIVE_TIMEOUT_S = 60
MAX_RESTARTS = 10
DEFAULT_FAULTS = (
    "crash@step=60:rank=1,kill@step=200:node=node3,hang@step=340:rank=2,"
    "nan@step=480:rank=0,slow@step=620:node=node1:factor=3"
)
BASELINE_FAULTS = ("crash", "hang", "kill", "slow", "nan")
TRANSOM_SPARES = [
    "--spares",
    "1",
    "--refill-spares",
]  # a new simulated node replaces each evicted one
RUN_TIMEOUT_S = 900
PROGRESS_EVERY_S = 10
POLL_S = 0.2
TARGET_SOONER = 0.28


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        env_names.MONITOR_PORT,
        env_names.FAULTS,
        env_names.CHECKPOINT_DIR,
        "TORCHELASTIC_RUN_ID",
    ):
        env.pop(name, None)
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: without it torchrun restarts reuse stale gloo addresses
    # from the previous attempt and fail or hang (pytorch issue 135712).
    return env | {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_args(args, final: Path) -> list[str]:
    return [
        str(SCRIPT),
        "--steps",
        str(args.steps),
        "--log-every",
        "1",
        "--ckpt-every",
        str(args.ckpt_every),
        "--save-final",
        str(final),
    ]


# -- measuring ------------------------------------------------------------------------------------


def rank0_timeline(lines: list[Line]) -> list[Line]:
    """Rank 0's resumed and step lines, in time order (one process after another)."""
    return sorted(
        (x for x in lines if x.what == "step" or (x.what == "resumed" and x.rank == 0)),
        key=lambda x: x.t,
    )


def step_durations(timeline: list[Line]) -> list[tuple[int, float, float]]:
    """(step, end time, duration) of every step rank 0 completed; a process's first step counts
    from its `resumed` line."""
    out, previous = [], None
    for x in timeline:
        if x.what == "step" and previous is not None:
            out.append((x.step, x.t, x.t - previous))
        previous = x.t
    return out


def measure(lines: list[Line], launched: float, steps: int, faults: list[dict]) -> dict:
    """wall_s, ettr_x, lost_steps and per-fault cost_s from rank 0's lines and the injections."""
    timeline = rank0_timeline(lines)
    done = step_durations(timeline)
    final = {}  # the last run of each step is the one in the final model
    for step, end, duration in done:
        final[step] = (end, duration)
    if set(final) != set(range(1, steps + 1)):
        missing = sorted(set(range(1, steps + 1)) - set(final))
        raise RuntimeError(f"rank 0 did not complete every step (missing {missing[:5]} ...)")
    wall = final[steps][0] - launched
    first_fault = min((f["time"] for f in faults), default=float("inf"))
    normal = statistics.median(
        [d for s, end, d in done if end < first_fault and s > 2] or [d for _, _, d in done]
    )
    resumes = [x.t for x in timeline if x.what == "resumed"]
    costs = []
    ordered = sorted(faults, key=lambda f: f["time"])
    for i, f in enumerate(ordered):
        t_f = f["time"]
        before = [s for s, end, _ in done if end <= t_f]
        s_f = max(before, default=0)
        if (
            f["fault"] == "slow"
        ):  # the extra time until the next fault (or the end) over the normal pace
            t_next = ordered[i + 1]["time"] if i + 1 < len(ordered) else final[steps][0]
            reached = max((s for s, end, _ in done if end <= t_next), default=s_f)
            t_back = max(end for s, end, _ in done if s == reached and end <= t_next)
            cost = (t_back - t_f) - (reached - s_f) * normal
        else:  # back at the highest step reached before the restart
            restart = min((t for t in resumes if t > t_f), default=None)
            if restart is None:
                cost, reached = None, s_f
            else:
                reached = max((s for s, end, _ in done if t_f < end < restart), default=s_f)
                # back when a step at or past `reached` is done, or a resume starts past it
                t_back = min(x.t for x in timeline if x.t >= restart and x.step >= reached)
                cost = (t_back - t_f) - (reached - s_f) * normal
        costs.append(
            {
                "id": f["id"],
                "fault": f["fault"],
                "step": f["step"],
                "target": f["target"],
                "at_step": s_f,
                "cost_s": cost,
            }
        )
    useful = sum(duration for _, duration in final.values())
    startup = min(end for s, end, _ in done if s == 1) - launched
    return {
        "wall_s": wall,
        "ettr_x": useful / wall,
        "lost_steps": len(done) - steps,
        "normal_step_s": normal,
        "startup_s": startup,
        "faults": costs,
    }


def compare_weights(path: Path, reference: Path | None) -> dict:
    """{"weights_match": bool, "max_abs_diff": float, "differing": [names]} against the reference."""
    if reference is None or not reference.exists():
        return {"weights_match": None}
    if not path.exists():
        return {"weights_match": False, "differing": ["(no final weights saved)"]}
    a, b = torch.load(path, weights_only=True), torch.load(reference, weights_only=True)
    differing = sorted(k for k in b if k not in a or not torch.equal(a[k], b[k]))
    diff = max(
        (float((a[k].float() - b[k].float()).abs().max()) for k in differing if k in a), default=0.0
    )
    return {"weights_match": not differing, "max_abs_diff": diff, "differing": differing[:5]}


def show_progress(
    system: str, lines: list[Line], launched: float, steps: int, last: list[float]
) -> None:
    if time.time() - last[0] < PROGRESS_EVERY_S:
        return
    last[0] = time.time()
    reached = max((x.step for x in lines if x.what == "step"), default=0)
    say(f"  {system}: step {reached}/{steps} after {time.time() - launched:.0f} s")


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


# -- Transom ----------------------------------------------------------------------------------------


def run_transom(args, work: Path, reference: Path | None) -> dict:
    job_id = "goodput-" + uuid.uuid4().hex[:6]
    run_dir = work / job_id
    final = work / f"{job_id}-final.pt"
    say(f"transom: {args.steps} steps with faults {args.faults} ...")
    logs = lambda: parse(
        "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("logs/g*/rank0.log")))
    )
    seen: set[str] = set()
    last = [time.time()]
    with open(work / f"{job_id}.out", "wb") as out:
        launched = time.time()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "transom",
                "run",
                "--run-dir",
                str(run_dir),
                "--job-id",
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
                *script_args(args, final),
            ],
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


# -- torchrun ---------------------------------------------------------------------------------------


class TorchrunJob:
    """Four torchrun agents (simulated nodes) and the injector that plays the fault schedule on them."""

    def __init__(self, args, work: Path, schedule: list[dict]):
        self.args = args
        self.work = work
        self.schedule = schedule
        self.run_id = "goodput-" + uuid.uuid4().hex[:6]
        self.ckpt = work / f"{self.run_id}-ckpt"
        self.final = work / f"{self.run_id}-final.pt"
        self.rdzv_port = free_port()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.lock = threading.Lock()
        self.agents: dict[str, subprocess.Popen] = {}  # node -> its current torchrun agent
        self.killed: list[subprocess.Popen] = []
        self.outputs: list[Path] = []
        self.steps: dict[int, int] = {}  # rank -> its newest reported step
        self.fired: list[dict] = []
        self.stopping = threading.Event()

    def command(self, node: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(NODES),
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{self.rdzv_port}",
            "--rdzv-id",
            self.run_id,
            "--rdzv-conf",
            f"is_host={int(node == 'node0')}",
            "--max-restarts",
            str(MAX_RESTARTS),
            *script_args(self.args, self.final),
            "--checkpoint",
            "torch",
            "--ckpt-dir",
            str(self.ckpt),
            "--fail-on-nan",
            "--collective-timeout",
            str(self.args.collective_timeout),
        ]

    def env(self, node: str) -> dict[str, str]:
        """The agent's environment: the monitor port, and the worker-side faults aimed at its worker."""
        faults = []
        for f in self.schedule:
            if f["type"] in WORKER_FAULTS and f["node"] in (None, node):
                faults.append(
                    f
                    | {"once_file": str(self.work / f"{self.run_id}-{f['id']}.fired")}
                    | ({"rank": None} if f["node"] else {})
                )
        return worker_env() | {
            env_names.MONITOR_PORT: str(self.sock.getsockname()[1]),
            env_names.FAULTS: json.dumps(faults),
        }

    def start_agent(self, node: str) -> None:
        out_path = self.work / f"{self.run_id}-{node}-{len(self.outputs)}.out"
        self.outputs.append(out_path)
        with open(out_path, "wb") as out:
            self.agents[node] = subprocess.Popen(
                self.command(node),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(node),
                start_new_session=True,
            )

    def lines(self) -> list[Line]:
        return [x for p in self.outputs if p.exists() for x in parse(p.read_text(errors="replace"))]

    # -- the injector ---------------------------------------------------------------------------
    def workers(self) -> dict[int, tuple[str, psutil.Process]]:
        """rank -> (node, worker process) of the running workers."""
        out = {}
        for node, agent in list(self.agents.items()):
            try:
                for child in psutil.Process(agent.pid).children(recursive=True):
                    rank = child.environ().get("RANK")
                    if rank is not None:
                        out[int(rank)] = (node, child)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return out

    def listen(self) -> None:
        pending = [f for f in self.schedule if f["type"] not in WORKER_FAULTS]
        while not self.stopping.is_set():
            try:
                message = json.loads(self.sock.recv(65536))
            except (TimeoutError, ValueError):
                continue
            rank = message.get("rank")
            if message.get("k") == "fault":  # the reporter fired a worker-side fault
                f = message["fault"]
                self.record(f, message["t"], message.get("step"), rank)
            elif message.get("k") == "step" and rank is not None:
                self.steps[rank] = message["step"]
                for f in [f for f in pending if message["step"] >= f["step"]]:
                    if self.inject(f):
                        pending.remove(f)

    def record(
        self, f: dict, when: float, step: int | None, rank: int | None, node: str | None = None
    ) -> None:
        node = node or f.get("node")
        target = f"{node} rank {rank}" if node else f"rank {rank}"
        self.fired.append(
            {"id": f["id"], "fault": f["type"], "step": step, "time": when, "target": target}
        )
        say(f"  torchrun: injected {f['type']} on {target} at step {step}")

    def inject(self, f: dict) -> bool:
        """Fire an agent-side fault if its target has reached its step; True once fired."""
        for rank, (node, worker) in self.workers().items():
            if (f["node"] or None) not in (None, node) or (f["node"] is None and f["rank"] != rank):
                continue
            if self.steps.get(rank, 0) < f["step"]:
                return False
            when = time.time()
            try:
                if f["type"] == "crash":
                    worker.send_signal(signal.SIGKILL)
                elif f["type"] == "hang":
                    worker.send_signal(signal.SIGSTOP)
                elif f["type"] == "kill":
                    with self.lock:
                        agent = self.agents.pop(node)
                        agent.kill()
                        worker.kill()
                        self.killed.append(agent)
                        self.start_agent(node)  # the hot spare takes its place at once
            except psutil.NoSuchProcess:
                return False
            self.record(f, when, self.steps.get(rank), rank, node)
            return True
        return False

    def run(self) -> dict:
        say(
            f"torchrun: {self.args.steps} steps with the same faults, collective timeout "
            f"{self.args.collective_timeout:g} s ..."
        )
        listener = threading.Thread(target=self.listen, name="fault-injector", daemon=True)
        launched = time.time()
        with self.lock:
            for i in range(NODES):
                self.start_agent(f"node{i}")
        listener.start()
        last = [time.time()]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                with self.lock:
                    running = [a for a in self.agents.values() if a.poll() is None]
                if not running:
                    break
                show_progress("torchrun", self.lines(), launched, self.args.steps, last)
                time.sleep(POLL_S)
        finally:
            self.stopping.set()
            listener.join()
            with self.lock:
                codes = [a.returncode for a in self.agents.values()]
                for agent in [*self.agents.values(), *self.killed]:
                    if agent.poll() is None:
                        agent.kill()
                        agent.wait()
            kill_marked(
                str(self.ckpt)
            )  # workers (a stopped one included) live in sessions of their own
            self.sock.close()
        if any(code != 0 for code in codes):
            raise RuntimeError(
                f"the torchrun job failed (agents exited {codes}); see {self.outputs}"
            )
        return measure(self.lines(), launched, self.args.steps, self.fired)


# -- the report -------------------------------------------------------------------------------------


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
        f"goodput: examples/train_gpt.py on {NODES} nodes x 1 worker, {args.steps} steps, checkpoint every "
        f"{args.ckpt_every} steps, {args.trials} trial(s)"
    )
    print(f"faults: {args.faults}")
    print(
        f"torchrun baseline: collective timeout {args.collective_timeout:g} s (torch's defaults are 10 min "
        f"for NCCL and 30 min for gloo, so the baseline is favoured); a killed node's agent is replaced at once"
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
            f"{system:<10}{fmt(r['wall_s']):>10}{fmt(r['ettr_x'], '.2f'):>9}{fmt(r['goodput_x'], '.2f'):>11}"
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
            f"Transom finishes {sooner:.0%} sooner than torchrun ({result['speedup_x']:.2f}x faster); "
            f"{verdict} the target of {TARGET_SOONER:.0%} (aim 50%)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})"
    )
    parser.add_argument(
        "--ckpt-every",
        type=int,
        default=CKPT_EVERY,
        metavar="K",
        help=f"both systems checkpoint every K steps (default {CKPT_EVERY})",
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
        schedule = parse_schedule(args.faults, NODES)
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
    if args.steps < 1 or args.ckpt_every < 1 or args.trials < 1:
        parser.exit(2, "goodput.py: --steps, --ckpt-every and --trials must be positive\n")
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
