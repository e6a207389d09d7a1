"""Scale benchmark: the real controller and the real agent logic on many nodes, one real etcd.

For each size N (`--nodes 64,256,1024`) it starts an embedded etcd, writes a job spec (N nodes,
1 spare, 1 rank a node, the node lease TTL of `--node-ttl`: default NODE_TTL_S, 20 s, a lease
for a 1,024-node job rather than the 8 s default meant for small jobs (Kubernetes gives a node
40 s; a dead node's workers are found by their exit and the monitor long before its lease
expires); agents renew it every TTL/2), two real `transom controller` candidates (processes,
as `transom run` starts them), and N + 1 simulated node agents spread over a few processes
(benchmarks/scale/agents.py: each a real NodeAgent whose workers, monitor, checkpoint server and
pre-flight are stand-ins, and whose plan watch stream, renewal thread and pause-guard thread
are shared by the agents of a process; its docstring says how they differ from real agents).
It measures (and reports node_ttl_s with each size):
  startup_s              launch -> the job record says generation 1 is RUNNING on all N nodes
  etcd_requests_per_s    requests etcd received per second in the steady state (its gRPC
                         messages, which the HTTP gateway's requests become), and per node
                         (etcd_requests_per_node_s; _by_method: Put, LeaseKeepAlive, Range...)
  etcd_cpu_x, controller_cpu_x   cores used in the steady state by etcd and the leading
                         controller (standby_cpu_x: the other candidate; simulator_cpu_x: the
                         simulated agents' processes); *_rss_mb their memory
  agent_ticks_per_s      loop turns an agent achieved per second (designed: 5; a turn reads
                         nothing from etcd, the plan comes by watch; less means the simulator
                         could not keep up, so its fence checks and reports came late)
  renewal_late_max_s     the most a simulated lease renewal was sent after its time in the
                         steady state (_startup_: before it); more than a fraction of TTL/2
                         means the simulator could not keep up (an agent counts an outage
                         after 5/8 of the TTL without an answer)
  fault_to_plan_s        a member node dies (its agent stops, then its lease is revoked: the
                         moment its lease expires) -> the plan of the next generation arrives
  fault_to_all_acting_s  the same moment -> every member of the new plan has followed it
  fault_to_all_started_s the same moment -> every member has started its (stand-in) workers,
                         which waits for the master node's rendezvous address
Agents follow the plan and controllers the cluster through etcd watches. Numbers from a
machine shared with other work are noisy; a size that does not start in --timeout seconds is
reported with why, and larger sizes are skipped.

    flock /work/wt/e2e.lock timeout 900 python -m benchmarks.scale --nodes 64,256,1024 --json

This module starts etcd, controllers and simulator processes and stops every one of them.
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from benchmarks import REPO, child_env
from transom.common import keys  # noqa: E402
from transom.common.records import JobRecord  # noqa: E402
from transom.common.states import JobState  # noqa: E402
from transom.job_spec import JobSpec  # noqa: E402
from transom.store import EmbeddedEtcd, Store, StoreError  # noqa: E402
from transom.store.etcd_client import REFRESHES_PER_TTL  # noqa: E402
from transom.store.watch import PrefixWatch  # noqa: E402
from transom.testing.jobs import etcd_requests_by_method
from transom.utils.procs import die_with_parent  # noqa: E402

SCRIPT = REPO / "examples" / "train_gpt.py"
AGENTS_PER_PROCESS = 256
WINDOW_S = 10.0
SETTLE_S = 3.0
PROGRESS_S = 15.0
FAULT_TIMEOUT_S = 60.0
NODE_TTL_S = 20
HARNESS_DEADLINE_S = 30.0
JOIN_TIMEOUT_S = 60.0
# Children are SIGTERMed (they clean up) when this benchmark's process dies, even by SIGKILL.
TERM_WITH_PARENT = functools.partial(die_with_parent, signal.SIGTERM)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cpu_s(process: psutil.Process) -> float:
    try:
        t = process.cpu_times()
        return (
            t.user
            + t.system
            + sum(
                c.cpu_times().user + c.cpu_times().system for c in process.children(recursive=True)
            )
        )
    except psutil.NoSuchProcess:
        return 0.0


def rss_mb(process: psutil.Process) -> float:
    try:
        return process.memory_info().rss / 2**20
    except psutil.NoSuchProcess:
        return 0.0


def lines_of(paths: list[Path]) -> list[list[str]]:
    lines = (line.split() for p in paths if p.exists() for line in p.read_text().splitlines())
    return [words for words in lines if words]  # a blank line (a log record's) says nothing


def revoke_lease_of(store: Store, name: str) -> None:
    """Revoke the lease `name` is held under: to etcd, the moment that lease expires."""
    client = store.client
    key = base64.b64encode(store.key(name).encode()).decode()
    kvs = client.post(client.get_url("/kv/range"), json={"key": key}).get("kvs", [])
    if not kvs or not kvs[0].get("lease"):
        raise RuntimeError(f"{name} has no lease")
    client.post(client.get_url("/lease/revoke"), json={"ID": kvs[0]["lease"]})


def registered(store: Store, n: int) -> str:
    """How many nodes are registered and report a status, in words (for progress lines)."""
    try:
        nodes, statuses = store.get_prefix(keys.NODES), store.get_prefix(keys.STATUS)
    except StoreError as e:  # counting is not worth failing the run for
        return f"etcd did not answer the count ({e})"
    return f"{len(nodes)} of {n + 1} nodes registered, {len(statuses)} statuses"


def simulators_failed(simulators: list[subprocess.Popen], outs: list[Path]) -> None:
    """Raise if a simulator process ended: its agents will never do what is waited for."""
    for p, out in zip(simulators, outs, strict=True):
        if p.poll() is not None:
            failed = [" ".join(x[1:]) for x in lines_of([out]) if x[0] == "failed"]
            why = failed[0] if failed else f"see {out}"
            raise RuntimeError(f"a simulator process exited with {p.returncode}: {why}")


def wait_job(watch: PrefixWatch, job: dict, until, timeout: float, progress, check) -> float:
    """Follow the `job` key until `until(JobRecord)` holds; the time it did. `progress()` says
    in words how far the job got (every PROGRESS_S, and in the error); `check()` raises if it
    never will."""
    deadline = time.monotonic() + timeout
    said = time.monotonic()
    while True:
        check()
        if time.monotonic() - said >= PROGRESS_S:
            said = time.monotonic()
            say(f"  {progress()}")
        if job.get("") is not None and until(JobRecord.from_dict(job[""])):
            return time.time()
        left = deadline - time.monotonic()
        if left <= 0:
            state = JobRecord.from_dict(job[""]).state.value if job.get("") else "none"
            raise TimeoutError(f"not reached in {timeout:.0f} s (job state {state}; {progress()})")
        update = watch.get(timeout=min(left, 1.0))
        if update is not None:
            if update.snapshot is not None:
                job.clear()
                job.update(update.snapshot)
            for e in update.events:
                job[e.name] = None if e.deleted else e.value


def run_size(n: int, work: Path, args) -> dict:
    job_id = f"scale-{n}-{uuid.uuid4().hex[:6]}"
    run_dir = work / job_id
    (run_dir / "kill").mkdir(parents=True)
    etcd = EmbeddedEtcd(run_dir / "etcd").start()
    children: list[subprocess.Popen] = []
    # The harness's own reads may wait: an etcd busy with 1,024 nodes' traffic answers late.
    store = Store(etcd.access, job_id, timeout=HARNESS_DEADLINE_S, deadline_s=HARNESS_DEADLINE_S)
    job_watch = PrefixWatch(store, keys.JOB)
    plan_watch = PrefixWatch(store, keys.PLAN)
    try:
        spec = JobSpec(
            script=str(SCRIPT),
            job_id=job_id,
            nnodes_min=n,
            nnodes_max=n,
            spares=1,
            nproc_per_node=1,
            warm_workers=False,
            metrics_port=-1,
            warmup_timeout_s=args.timeout,
            # All N members and the spare, or after JOIN_TIMEOUT_S the N members without it: a
            # spare that lost its lease on a starved simulator must not hold the start back.
            join_timeout_s=min(JOIN_TIMEOUT_S, args.timeout / 2),
            node_ttl_s=args.node_ttl,
        )
        store.put(keys.SPEC, spec.validate().to_dict())
        base = [sys.executable, "-m", "transom", "--log-level", "warning"]
        common = [*etcd.access.argv(), "--job-id", job_id]
        job = job_watch.start()
        plan_watch.start()
        launched = time.time()
        controllers = {}
        for i in range(2):
            name = f"controller-{i}"
            with open(run_dir / f"{name}.log", "wb") as log:
                p = subprocess.Popen(
                    [*base, "controller", *common, "--candidate-id", name],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=TERM_WITH_PARENT,
                )
            children.append(p)
            controllers[name] = psutil.Process(p.pid)
        nodes = [f"node{i}" for i in range(n + 1)]
        parts = math.ceil(len(nodes) / AGENTS_PER_PROCESS)
        outs = []
        sims = []
        simulator_children = []
        for k in range(parts):
            out = run_dir / f"agents-{k}.out"
            outs.append(out)
            with open(out, "wb") as f:
                p = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.scale.agents",
                        *etcd.access.argv(),
                        "--job-id",
                        job_id,
                        "--run-dir",
                        str(run_dir),
                        "--kill-dir",
                        str(run_dir / "kill"),
                        *nodes[k::parts],
                    ],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env=child_env(os.environ),
                    preexec_fn=TERM_WITH_PARENT,
                )
            children.append(p)
            simulator_children.append(p)
            sims.append(psutil.Process(p.pid))
        check = functools.partial(simulators_failed, simulator_children, outs)
        say(f"{n} nodes: {parts} simulator processes, 2 controllers; waiting for generation 1")
        running = wait_job(
            job_watch,
            job,
            lambda j: j.state is JobState.RUNNING and j.generation >= 1,
            args.timeout,
            lambda: registered(store, n),
            check,
        )
        result: dict = {
            "nodes": n,
            "startup_s": running - launched,
            "simulator_processes": parts,
            "node_ttl_s": args.node_ttl,
        }
        say(f"{n} nodes: running after {result['startup_s']:.1f} s; steady state ...")
        time.sleep(SETTLE_S)
        leader = store.get(keys.LEADER)
        etcd_process = psutil.Process(etcd.process.pid)  # type: ignore[union-attr]
        procs = {
            "etcd": [etcd_process],
            "controller": [controllers[leader]],
            "standby": [p for c, p in controllers.items() if c != leader],
            "simulator": sims,
        }
        before = {k: sum(cpu_s(p) for p in ps) for k, ps in procs.items()}
        requests_before, t0 = etcd_requests_by_method(store), time.time()
        time.sleep(args.window)
        after = {k: sum(cpu_s(p) for p in ps) for k, ps in procs.items()}
        requests_after, t1 = etcd_requests_by_method(store), time.time()
        for k in procs:
            result[f"{k}_cpu_x"] = (after[k] - before[k]) / (t1 - t0)
        rates = {
            m: (c - requests_before.get(m, 0.0)) / (t1 - t0) for m, c in requests_after.items()
        }
        result["etcd_requests_per_s"] = sum(rates.values())
        result["etcd_requests_per_node_s"] = result["etcd_requests_per_s"] / n
        result["etcd_requests_per_node_s_by_method"] = {
            m: round(r / n, 4) for m, r in sorted(rates.items(), key=lambda x: -x[1]) if r > 0
        }
        ticks = [(float(x[2]), int(x[1])) for x in lines_of(outs) if x[0] == "ticks"]
        # each process prints its own total: sum per-process rates over the window
        rate = 0.0
        for out in outs:
            own = [(float(x[2]), int(x[1])) for x in lines_of([out]) if x[0] == "ticks"]
            inside = [(t, c) for t, c in own if t0 <= t <= t1]
            if len(inside) >= 2:
                rate += (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
        result["agent_ticks_per_s"] = rate / (n + 1) if ticks else None
        # the most a lease renewal was sent after its time: in the window, and since start
        late = [(float(x[2]), float(x[3])) for x in lines_of(outs) if x[0] == "ticks"]
        result["renewal_late_max_s"] = max((v for t, v in late if t0 <= t <= t1), default=None)
        result["renewal_late_startup_max_s"] = max((v for t, v in late if t < t0), default=None)
        result["etcd_rss_mb"] = rss_mb(etcd_process)
        result["controller_rss_mb"] = rss_mb(controllers[leader])
        result.update(fault(store, plan_watch, run_dir, outs, check))
        return result
    finally:
        for p in children:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in children:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        job_watch.stop()
        plan_watch.stop()
        etcd.stop()


def fault(store: Store, plan_watch: PrefixWatch, run_dir: Path, outs: list[Path], check) -> dict:
    """Kill one member node; the times until the new plan and until every member acted on it
    (`check()` raises if a simulator ended)."""
    plan = store.get(keys.PLAN)
    # The last member that holds a registration now (on a starved simulator a node's lease may
    # have lapsed and its agent be registering again: its expiry would not be this fault's).
    live = store.get_prefix(keys.NODES)
    victim = next((m for m in reversed(plan["members"]) if m in live), plan["members"][-1])
    (run_dir / "kill" / victim).touch()
    deadline = time.monotonic() + 10
    while not any(x[:2] == ["dead", victim] for x in lines_of(outs)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the simulated agent {victim} did not stop")
        time.sleep(0.05)
    while plan_watch.get(timeout=0) is not None:  # forget older plans
        pass
    revoke_lease_of(store, keys.node(victim))
    t_fault = time.time()
    deadline = time.monotonic() + FAULT_TIMEOUT_S
    new_plan = None
    while new_plan is None:
        update = plan_watch.get(timeout=max(0.0, deadline - time.monotonic()))
        if update is None:
            raise TimeoutError(f"no new plan {FAULT_TIMEOUT_S:.0f} s after {victim}'s death")
        values = [e.value for e in update.events if e.name == ""]  # not a master address
        values.append((update.snapshot or {}).get(""))
        new_plan = next((p for p in values if p and p["generation"] > plan["generation"]), None)
    t_plan = time.time()
    gen, members = new_plan["generation"], set(new_plan["members"])
    times: dict[str, dict[str, float]] = {"acted": {}, "started": {}}
    while True:
        for x in lines_of(outs):
            if x[0] in times and int(x[2]) == gen:
                times[x[0]][x[1]] = float(x[3])
        if all(members <= set(t) for t in times.values()):
            break
        if time.monotonic() > deadline:
            late = {what: len(members - set(t)) for what, t in times.items()}
            raise TimeoutError(f"members never acted on / started generation {gen}: {late}")
        check()
        time.sleep(0.1)
    return {
        "fault_to_plan_s": t_plan - t_fault,
        "fault_to_all_acting_s": max(times["acted"][m] for m in members) - t_fault,
        "fault_to_all_started_s": max(times["started"][m] for m in members) - t_fault,
        "victim": victim,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", default="64,256,1024", help="sizes, comma-separated")
    parser.add_argument("--window", type=float, default=WINDOW_S, help="steady-state seconds")
    parser.add_argument("--timeout", type=float, default=300.0, help="start-up limit per size")
    parser.add_argument(
        "--node-ttl",
        type=int,
        default=NODE_TTL_S,
        help=f"the job's node lease TTL, seconds (default {NODE_TTL_S}; renewed every TTL/2)",
    )
    parser.add_argument(
        "--keep", type=Path, help="run in this directory and keep it (logs, simulator output)"
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    # `timeout` (or anyone) sending SIGTERM: unwind, so every size's `finally` stops its etcd,
    # controllers and simulators.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    say(
        f"node lease TTL {args.node_ttl} s (--node-ttl), renewed every "
        f"{args.node_ttl / REFRESHES_PER_TTL:g} s"
    )
    sizes, errors = [], {}
    with tempfile.TemporaryDirectory(prefix="transom-scale-") as tmp:
        work = args.keep or Path(tmp)
        for n in [int(x) for x in args.nodes.split(",")]:
            try:
                sizes.append(run_size(n, work, args))
            except Exception as e:  # noqa: BLE001 - reported, and the larger sizes skipped
                errors[str(n)] = f"{type(e).__name__}: {e}"
                say(f"{n} nodes: {errors[str(n)]}")
                break
    columns = [
        "nodes",
        "startup_s",
        "fault_to_plan_s",
        "fault_to_all_acting_s",
        "fault_to_all_started_s",
        "etcd_requests_per_s",
        "etcd_requests_per_node_s",
        "etcd_cpu_x",
        "controller_cpu_x",
        "standby_cpu_x",
        "simulator_cpu_x",
        "agent_ticks_per_s",
    ]
    print(" ".join(f"{c:>12.12}" for c in columns))
    for row in sizes:
        print(
            " ".join(
                f"{row[c]:>12.3f}" if isinstance(row[c], float) else f"{row[c]:>12}"
                for c in columns
            )
        )
    print(f"node lease TTL {args.node_ttl} s")
    for n, why in errors.items():
        print(f"{n} nodes: not measured: {why}")
    result = {
        "sizes": sizes,
        "errors": errors,
        "reached": max((r["nodes"] for r in sizes), default=0),
        "cores": psutil.cpu_count(),
        "node_ttl_s": args.node_ttl,
    }
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
