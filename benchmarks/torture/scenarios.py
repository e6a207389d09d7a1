"""The torture suite's scenarios: which job, which fault, and what the issue says must follow.

Each `Scenario` names a job kind (`local`: `transom run`; `proxied`: every node behind its own
etcd proxy, see job.py), a step count, extra `transom run` options, a fault function
(job, rng) -> extra measurements, and `expect`: the outcome issue 11 asks for, checked against
the measured row by `check`. Faults are injected once training passed FAULT_STEP (two
checkpoints in node memory), unless a scenario says another step. Times in the extra
measurements are seconds after the fault, on this machine's one clock (every process of a trial
runs here). The kill-during-save scenarios (issue 13) are in kills.py.

This module injects faults only into the processes of the job it is given.
"""

from __future__ import annotations

import operator
import random
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from benchmarks.torture.job import Job
from benchmarks.torture.measure import ExitWatch
from transom.checkpoint.shm_dirs import default_shm_dir
from transom.common import keys
from transom.testing.jobs import wait_for

FAULT_STEP = 8
NODE_TTL_S = 4  # JobSpec.node_ttl_s's default, which the jobs use
SHORT, LONG = 60, 160  # steps: LONG for the faults that last 20-30 s
VICTIM = "node1"  # a member that is not generation 1's master (node0)
START = re.compile(r"\[train_gpt\] start rank=\d+ world=\d+ t=(\d+\.\d+)")
STEP_T = re.compile(r"^step (\d+) .*?t=(\d+\.\d+)", re.M)

OPS = {"==": operator.eq, "<=": operator.le, ">=": operator.ge, "<": operator.lt}


@dataclass
class Scenario:
    name: str
    what: str
    kind: str  # local | proxied
    steps: int
    fault: Callable[[Job, random.Random], dict]
    expect: dict[str, tuple[str, object]]
    options: list[str] = field(default_factory=list)
    # After the fault, how long the job may take to end; with the start (150 s at most) and
    # the fault it keeps one trial under 10 minutes (the shared lock's limit).
    timeout_s: float = 240
    fault_step: int = FAULT_STEP  # the fault comes once rank 0 completed this step
    # The scenario's measurements beyond the common row (job) -> fields, after the job ended.
    measures: Callable[[Job], dict] | None = None


def check(scenario: Scenario, row: dict) -> list[str]:
    """The expectations `row` does not meet, in words (empty: as the issue asks). A wanted value
    "=NAME" is the row's field NAME (worker_kill_ckpt: one restart per kill)."""
    failed = []
    for name, (op, want) in scenario.expect.items():
        got = row.get(name)
        if isinstance(want, str) and want.startswith("="):  # another measured field
            want = row.get(want[1:])
        if got is None or not OPS[op](got, want):
            failed.append(f"{name}={got!r} (want {op} {want!r})")
    return failed


NOTHING_LOST = {
    "succeeded": ("==", True),
    "identical": ("==", True),
    "wrong_loads": ("==", 0),
    "leftovers": ("==", 0),
}


def no_restart(**more) -> dict:
    return {**NOTHING_LOST, "restarts": ("==", 0), "evictions": ("==", 0), **more}


# -- helpers ------------------------------------------------------------------------------------
def steps_between(job: Job, t0: float, t1: float) -> int:
    """Steps rank 0 completed between t0 and t1 (training through the fault)."""
    text = job.log_text("g*/rank0.log")
    return sum(1 for _, t in STEP_T.findall(text) if t0 <= float(t) <= t1)


def generation_event(job: Job, generation: int) -> dict | None:
    for event in (job.read(keys.EVENTS, prefix=True) or {}).values():
        if event.get("kind") == "generation" and event.get("generation") == generation:
            return event
    return None


def first_start(job: Job, generation: int) -> float | None:
    text = job.log_text(f"g{generation:03d}/rank*.log")
    starts = [float(t) for t in START.findall(text)]
    return min(starts) if starts else None


def after(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 2)


# -- faults -------------------------------------------------------------------------------------
def etcd_stop(seconds: float) -> Callable[[Job, random.Random], dict]:
    def fault(job, rng) -> dict:
        etcd = job.etcd()
        t0 = time.time()
        etcd.suspend()
        try:
            time.sleep(seconds)
        finally:
            etcd.resume()
        return {"stalled_s": seconds, "steps_during_stall": steps_between(job, t0, t0 + seconds)}

    return fault


def etcd_kill(job, rng) -> dict:
    etcd = job.etcd()
    t0 = time.time()
    etcd.kill()
    try:
        new = wait_for(
            lambda: (p := job.etcd()) is not None and p.pid != etcd.pid and p, 30, "etcd"
        )
        return {"etcd_restarted_after_s": after(new.create_time(), t0)}
    except TimeoutError:
        return {"etcd_restarted_after_s": None}


def controller_kill(state: str) -> Callable[[Job, random.Random], dict]:
    def fault(job, rng) -> dict:
        extra = {}
        if state == "RECOVERING":  # a worker crash makes an incident; the leader dies in it
            pid = job.worker_pids().get(1)
            extra["worker_killed"] = pid is not None
            if pid is not None:
                signal_pid(pid, signal.SIGKILL)
        try:
            wait_for(lambda: job.job_state() == state, 20, state, interval=0.02)
        except TimeoutError:
            pass
        leader, name = job.leader(), job.read(keys.LEADER)
        extra["killed_in"] = job.job_state()
        t0 = time.time()
        if leader is not None:
            leader.kill()
        try:
            wait_for(lambda: job.read(keys.LEADER) not in (None, name), 30, "a new leader")
            extra["new_leader_after_s"] = after(time.time(), t0)
        except TimeoutError:
            extra["new_leader_after_s"] = None
        return extra

    return fault


def agent_signal(signum: int) -> Callable[[Job, random.Random], dict]:
    def fault(job, rng) -> dict:
        agent = job.agent(VICTIM)
        server = job.find("transom.checkpoint.server", "--node-id", VICTIM)
        watch = ExitWatch([agent.pid])
        t0 = time.time()
        agent.send_signal(signum)
        extra: dict = {}
        try:
            wait_for(watch.last_exit, 40, "the agent to exit", interval=0.05)
        except TimeoutError:
            pass
        watch.stop()
        extra["agent_exit_after_s"] = after(watch.last_exit(), t0)
        if signum == signal.SIGTERM and watch.last_exit() is not None:
            time.sleep(1.0)  # what the agent left, before the launcher's own clean-up at the end
            extra["server_alive_after_exit"] = server is not None and alive(server)
            extra["shm_left_after_exit"] = default_shm_dir(job.job_id, VICTIM).exists()
            extra["still_registered"] = job.read(keys.node(VICTIM)) is not None
        return extra

    return fault


def alive(process) -> bool:
    """Running and not a zombie (psutil's is_running counts a zombie as running)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def signal_pid(pid: int, signum: int) -> None:
    import os

    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def cut_off(job, rng) -> dict:
    """Blackhole VICTIM's way to etcd; time its eviction, its old workers' end, the next start."""
    generation = (job.read(keys.JOB) or {}).get("generation", 1)
    workers = list(job.worker_pids(VICTIM).values())
    server = job.find("transom.checkpoint.server", "--node-id", VICTIM)
    old = ExitWatch(workers)
    server_watch = ExitWatch([server.pid] if server else [])
    t0 = time.time()
    job.proxies[VICTIM].set_blackhole()
    extra: dict = {"old_workers": len(workers)}
    try:
        evicted = wait_for(
            lambda: ((job.read(keys.JOB) or {}).get("evicted") or {}).get(VICTIM), 60, "eviction"
        )
        extra["evicted_after_s"] = after(evicted["time"], t0)
        plan = wait_for(lambda: generation_event(job, generation + 1), 60, "the next generation")
        extra["next_plan_after_s"] = after(plan["time"], t0)
        start = wait_for(lambda: first_start(job, generation + 1), 60, "the next workers")
        extra["next_workers_start_after_s"] = after(start, t0)
        wait_for(old.last_exit, 30, "the old workers to stop", interval=0.05)
    except TimeoutError as e:
        extra["timeout"] = str(e)
    extra["old_workers_stopped_after_s"] = after(old.last_exit(), t0)
    extra["ckpt_server_stopped_after_s"] = after(server_watch.last_exit(), t0)
    if old.last_exit() is not None and extra.get("next_workers_start_after_s") is not None:
        extra["overlap_s"] = round(old.last_exit() - t0 - extra["next_workers_start_after_s"], 2)
    old.stop()
    server_watch.stop()
    time.sleep(max(0.0, t0 + 20 - time.time()))
    job.proxies[VICTIM].set_pass()  # the partition heals: the node learns it was evicted
    return extra


def slow_store(delay_s: float, for_s: float) -> Callable[[Job, random.Random], dict]:
    def fault(job, rng) -> dict:
        t0 = time.time()
        for proxy in job.proxies.values():
            proxy.set_delay(delay_s)
        time.sleep(for_s)
        for proxy in job.proxies.values():
            proxy.set_pass()
        return {"steps_during_slow": steps_between(job, t0, t0 + for_s)}

    return fault


ttl = NODE_TTL_S
SCENARIOS = [
    Scenario("etcd_stop_2s", "etcd SIGSTOPped for 2 s", "local", SHORT, etcd_stop(2), no_restart()),
    Scenario(
        "etcd_stop_ttl+2s",
        f"etcd SIGSTOPped for the node TTL + 2 s ({ttl + 2} s)",
        "local",
        SHORT,
        etcd_stop(ttl + 2),
        no_restart(),
    ),  # fmt: skip
    Scenario(
        "etcd_stop_30s",
        "etcd SIGSTOPped for 30 s (--store-outage 45)",
        "local",
        LONG,
        etcd_stop(30),
        no_restart(),
        options=["--store-outage", "45"],
    ),  # fmt: skip
    Scenario(
        "etcd_kill",
        "etcd SIGKILLed (the launcher must restart it)",
        "local",
        SHORT,
        etcd_kill,
        no_restart(etcd_restarted_after_s=("<=", 10)),
    ),  # fmt: skip
    Scenario(
        "controller_kill_running",
        "the leading controller SIGKILLed in RUNNING",
        "local",
        SHORT,
        controller_kill("RUNNING"),
        no_restart(new_leader_after_s=("<=", 10)),
    ),  # fmt: skip
    Scenario(
        "controller_kill_recovering",
        "rank 1's worker SIGKILLed, then the leading controller in RECOVERING",
        "local",
        SHORT,
        controller_kill("RECOVERING"),
        {**NOTHING_LOST, "restarts": ("==", 1), "evictions": ("==", 0)},
    ),  # fmt: skip
    Scenario(
        "node_cut_off",
        f"{VICTIM} cut off from etcd only (its proxy blackholed for 20 s)",
        "proxied",
        SHORT,
        cut_off,
        {
            **NOTHING_LOST,
            "restarts": ("==", 1),
            "evictions": ("==", 1),
            "evicted_after_s": ("<=", ttl + 2),
            "overlap_s": ("<", 0),
        },
    ),  # fmt: skip
    Scenario(
        "agent_sigterm",
        f"{VICTIM}'s agent SIGTERMed",
        "local",
        SHORT,
        agent_signal(signal.SIGTERM),
        {
            **NOTHING_LOST,
            "restarts": ("<=", 1),
            "agent_exit_after_s": ("<=", 30),
            "shm_left_after_exit": ("==", False),
            "still_registered": ("==", False),
        },
    ),  # fmt: skip
    Scenario(
        "agent_sigkill",
        f"{VICTIM}'s agent SIGKILLed (a spare replaces the node)",
        "local",
        SHORT,
        agent_signal(signal.SIGKILL),
        {**NOTHING_LOST, "restarts": ("==", 1), "evictions": ("==", 1)},
    ),  # fmt: skip
    Scenario(
        "slow_store",
        "every etcd request delayed 5 s, for 20 s",
        "proxied",
        LONG,
        slow_store(5, 20),
        no_restart(),
    ),  # fmt: skip
]
BY_NAME = {s.name: s for s in SCENARIOS}
