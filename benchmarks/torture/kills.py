"""The torture suite's kill-during-save scenarios (issue 13): SIGKILL a node's worker, checkpoint
server or agent at random moments around a checkpoint, and mix in a fresh start, a NaN rollback
and an elastic shrink (and grow), then check that no rank ever loaded the wrong bytes.

`kill_moments(victims, mixed)` is the one fault function: each of its `job.kills` kills picks a
random rank of the current generation and kills the chosen kind of process of that rank's node:
  worker  the rank's worker process (the node's agent restarts the generation)
  server  the node's checkpoint server, `transom.checkpoint.server` (its shards in node memory
          are gone; the agent starts a new server; peers and storage keep copies)
  agent   the node's agent (the node dies: its workers and server die with it)
at a random moment after rank 0 printed a checkpoint step (the save, the replication to a peer,
the persistence to storage, or training between them), then waits until the job recovered (a new
generation trains, or, after a server kill that cost no restart, the node's new server serves)
before the next kill, which waits for a later checkpoint step. With `mixed`, the first kill
is a worker's before any checkpoint exists (the next generation starts fresh and re-saves the
same step numbers under a new timeline) and the second an agent's (in an elastic job with no
spare: the job shrinks to 2 nodes; --refill-spares brings a node back, which a later restart
takes: a grow); the scenario's `--faults nan@...` adds a rollback.

`phases` classifies each kill afterwards by the victim rank's checkpoint events; `timeline`
counts the fresh starts, rollbacks, shrinks and grows a trial went through.
This module signals only the processes of the job it is given.
"""

from __future__ import annotations

import math
import random
import re
import signal
import socket
import time
from collections.abc import Callable

import psutil

from benchmarks.torture.job import STEP_DELAY_S, Job
from benchmarks.torture.scenarios import NOTHING_LOST, SHORT, Scenario
from transom.common import keys
from transom.testing.jobs import wait_for

VICTIMS = ("worker", "server", "agent")
MIXED_STEPS = 120  # room for 6-8 kills (a server's restart takes seconds of training)
NAN_STEP = 40  # the mixed scenario's NaN (rank 0): a rollback to a step before it
UNFINISHED_S = 5.0  # a phase that never finished (its worker was killed) counts this long
RECOVERY_S = 120.0
# A kill comes this long after rank 0 prints a checkpoint step, at most (one window drawn, then
# a time in it: half the kills within 30 ms). The save runs from ~5-10 ms to 20-50 ms after the
# print for this model; replication and persistence end 50-100 ms after it; the last window
# reaches into the next steps' training. The print's time is predicted from the step before
# (its t= and the step period), since the log reaches this harness later than the save starts.
KILL_WINDOWS_S = (0.03, 0.03, 0.15, 0.5 + STEP_DELAY_S)
STEP_LINE = re.compile(r"^step (\d+) loss (\S+) t=", re.M)
STEP_TIME = re.compile(r"^step (\d+) .*?t=(\d+\.\d+)", re.M)


def _generation(job: Job) -> int:
    return int((job.read(keys.JOB) or {}).get("generation") or 0)


def _current_step(job: Job) -> int:
    """The newest step rank 0 of the newest generation with a log has completed (0: none)."""
    logs = sorted((job.run_dir / "logs").glob("g[0-9]*/rank0.log"))
    if not logs:
        return 0
    steps = [int(s) for s, _ in STEP_LINE.findall(logs[-1].read_text(errors="replace"))]
    return max(steps, default=0)


def _before_ckpt_step(job: Job, after_step: int) -> tuple[int, float] | None:
    """(s, predicted time of rank 0's print of s) once rank 0 printed step s-1, where s is a
    checkpoint step past `after_step` + 2: the print of s-1 plus the recent step period."""
    logs = sorted((job.run_dir / "logs").glob("g[0-9]*/rank0.log"))
    if not logs:
        return None
    times = {int(s): float(t) for s, t in STEP_TIME.findall(logs[-1].read_text(errors="replace"))}
    if not times:
        return None
    newest = max(times)
    step = newest + 1
    if step % job.ckpt_every or step <= after_step + 2 or newest - 1 not in times:
        return None
    return step, times[newest] + (times[newest] - times[newest - 1])


def _generation_trains(job: Job, generation: int) -> bool:
    log = job.run_dir / "logs" / f"g{generation:03d}" / "rank0.log"
    return log.exists() and STEP_LINE.search(log.read_text(errors="replace")) is not None


def rank_nodes(job: Job) -> dict[int, tuple[str, int]]:
    """rank -> (node, worker pid) of the current generation, as the agents report."""
    generation = (job.read(keys.JOB) or {}).get("generation")
    out = {}
    for node, status in (job.read(keys.STATUS, prefix=True) or {}).items():
        if status.get("generation") == generation:
            out.update({int(r): (node, int(pid)) for r, pid in (status.get("pids") or {}).items()})
    return out


def _victim(job: Job, kind: str, node: str, worker_pid: int) -> psutil.Process | None:
    if kind == "worker":
        try:
            return psutil.Process(worker_pid)
        except psutil.Error:
            return None
    if kind == "server":
        return job.find("transom.checkpoint.server", "--node-id", node)
    return job.agent(node)


def _choose(job: Job, kind: str, rng: random.Random) -> tuple[int, str, psutil.Process] | None:
    """A random rank of the current generation, its node and its victim process of `kind`."""
    try:
        ranks = wait_for(lambda: job.ended() or rank_nodes(job), 30, "the ranks")
    except TimeoutError:
        return None
    if ranks is True:  # the job ended
        return None
    rank = rng.choice(sorted(ranks))
    node, worker = ranks[rank]
    victim = _victim(job, kind, node, worker)
    return None if victim is None else (rank, node, victim)


def _recovered(job: Job, kind: str, generation: int, node: str, pid: int) -> bool:
    """The next generation trains; or, after a server kill that cost no restart, the node's new
    server serves."""
    if _generation_trains(job, generation + 1):
        return True
    if kind != "server":
        return False
    server = job.find("transom.checkpoint.server", "--node-id", node)
    return server is not None and server.pid != pid and _serving(server)


def _serving(server: psutil.Process) -> bool:
    """The server answers on its Unix socket (its `--socket` argument)."""
    try:
        argv = server.cmdline()
        path = argv[argv.index("--socket") + 1]
    except (psutil.Error, ValueError, IndexError):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def kill_moments(
    victims: tuple[str, ...], mixed: bool = False
) -> Callable[[Job, random.Random], dict]:
    """The fault: `job.kills` kills, each of a kind drawn from `victims` (see the docstring)."""

    def fault(job: Job, rng: random.Random) -> dict:
        kinds = [rng.choice(victims) for _ in range(job.kills)]
        if mixed:
            kinds[:2] = ["worker", "agent"][: len(kinds)]
        moments: list[dict] = []
        last, stopped = _current_step(job), None
        for i, kind in enumerate(kinds):
            fresh = mixed and i == 0
            # The victim is chosen first (etcd and process-table reads take tens of ms), so the
            # kill follows the checkpoint step by no more than its drawn delay.
            chosen, generation = _choose(job, kind, rng), _generation(job)
            if fresh:  # before the first checkpoint's save: nothing restorable yet
                step = _current_step(job)
                time.sleep(rng.uniform(0, STEP_DELAY_S))
            else:
                try:
                    ahead = wait_for(
                        lambda last=last: job.ended() or _before_ckpt_step(job, last),
                        RECOVERY_S,
                        "the step before a checkpoint",
                        0.01,
                    )
                except TimeoutError:
                    stopped = f"kill {i + 1}: no checkpoint step after step {last}"
                    break
                if ahead is True:
                    stopped = f"kill {i + 1}: the job ended"
                    break
                step, printed = ahead
                at = printed + rng.uniform(0, rng.choice(KILL_WINDOWS_S))
                time.sleep(max(0.0, at - time.time()))
            if chosen is None or not chosen[2].is_running():  # gone meanwhile: choose again
                chosen, generation = _choose(job, kind, rng), _generation(job)
            if job.ended() or chosen is None:
                stopped = f"kill {i + 1}: " + ("the job ended" if job.ended() else f"no {kind}")
                break
            rank, node, victim = chosen
            t = time.time()
            try:
                victim.send_signal(signal.SIGKILL)
            except psutil.Error:
                stopped = f"kill {i + 1}: the {kind} of {node} was gone"
                break
            moments.append(
                {"time": t, "victim": kind, "rank": rank, "node": node, "step": step}
                | ({"before_any_checkpoint": step < job.ckpt_every} if fresh else {})
            )
            try:
                wait_for(
                    lambda k=kind, g=generation, n=node, p=victim.pid: (
                        job.ended() or _recovered(job, k, g, n, p)
                    ),
                    RECOVERY_S,
                    "recovery",
                    0.2,
                )
            except TimeoutError:
                stopped = f"kill {i + 1}: no recovery within {RECOVERY_S:.0f} s"
                break
            last = _current_step(job)
        job.moments = moments
        return {
            "kills": len(moments),
            "kills_by_victim": {k: sum(m["victim"] == k for m in moments) for k in VICTIMS},
            "kills_stopped": stopped,  # why fewer kills than --kills were made (None: all made)
        }

    return fault


def phase_of(job: Job, moments: list[dict]) -> list[str]:
    """Each kill's checkpoint phase for the victim rank's shards: save (the worker's copy into
    node memory: staged..saved), replication (saved..replicated), persistence
    (replicated..persisted), else training. A step saved again by a later generation is a new
    shard (its own times)."""
    shards: dict[tuple[int, int], list[dict[str, float]]] = {}
    for e in sorted(job.events(), key=lambda e: e["time"]):
        if e.get("kind") != "checkpoint" or e.get("step") is None or e.get("rank") is None:
            continue
        copies = shards.setdefault((e["step"], e["rank"]), [])
        if e.get("action") == "saved":
            copies.append({"staged": e.get("staged") or e["time"], "saved": e["time"]})
        elif copies and e.get("action") in ("replicated", "persisted"):
            copies[-1].setdefault(e["action"], e["time"])
    out = []
    for m in moments:
        phase = "training"
        for (_step, rank), copies in shards.items():
            for t in copies if rank == m["rank"] else []:
                bounds = [
                    ("save", t["staged"], t["saved"]),
                    ("replication", t["saved"], t.get("replicated")),
                    ("persistence", t.get("replicated"), t.get("persisted")),
                ]
                for name, lo, hi in bounds:
                    end = hi if hi is not None else (lo or 0) + UNFINISHED_S
                    if lo is not None and lo <= m["time"] < end:
                        phase = name
        out.append(phase)
    return out


def phases(job: Job, moments: list[dict]) -> dict[str, dict[str, int]]:
    """Kills per victim kind and phase, e.g. {"worker": {"save": 2, "training": 1}, ...}."""
    counts: dict[str, dict[str, int]] = {}
    for m, phase in zip(moments, phase_of(job, moments), strict=True):
        by_phase = counts.setdefault(m.get("victim", "worker"), {})
        by_phase[phase] = by_phase.get(phase, 0) + 1
    return counts


def timeline(events: list[dict]) -> dict[str, int]:
    """What the generations went through: fresh starts (a later generation with no restore
    step), rollbacks (the first generation after a NaN fault resumes before its step), shrinks
    and grows (fewer or more members than the generation before)."""
    gens = sorted(
        (e for e in events if e.get("kind") == "generation" and e.get("generation")),
        key=lambda e: e["generation"],
    )
    nans = [e for e in events if e.get("kind") == "fault" and e.get("fault") == "nan"]
    out = {"fresh_starts": 0, "rollbacks": 0, "shrinks": 0, "grows": 0}
    for n in nans:  # the first generation after the NaN resumes before its step
        after = next((g for g in gens if g["time"] > n["time"]), None)
        if after is not None and n.get("step") is not None:
            out["rollbacks"] += (after.get("restore_step") or 0) < n["step"]
    for before, g in zip(gens, gens[1:], strict=False):
        out["fresh_starts"] += g.get("restore_step") is None
        members, previous = len(g.get("members") or []), len(before.get("members") or [])
        out["shrinks"] += members < previous
        out["grows"] += members > previous
    return out


def loss_mismatches(job: Job) -> list[str]:
    """Resumes whose first loss disagrees with the timeline they should continue: a generation
    resumed at step s > 0 must print at s+1 the loss that the generation whose step s it
    restored printed at s+1, if that one got there (rank 0's loss at s+1 is a function of the
    weights after step s and of rank 0's batch alone, so it holds across a change of world size
    too). The step s restored is the newest earlier generation's that trained s or resumed at
    it: a generation that started afresh and trained s begins a new timeline, and older ones
    are not compared. Non-finite losses (a NaN fault) are not compared. One line per
    mismatch."""
    printed: list[tuple[int, int, dict[int, str]]] = []  # (generation, resumed, step -> loss)
    for log in sorted((job.run_dir / "logs").glob("g[0-9]*/rank0.log")):
        text = log.read_text(errors="replace")
        resumed = re.search(r"\[train_gpt\] resumed step=(\d+)", text)
        if resumed is None:
            continue
        losses = {int(s): v for s, v in STEP_LINE.findall(text)}
        printed.append((int(log.parent.name[1:]), int(resumed.group(1)), losses))
    out = []
    for i, (g, s, losses) in enumerate(printed):
        if s == 0 or s + 1 not in losses:
            continue
        for g0, s0, before in reversed(printed[:i]):
            if not (s in before or s0 == s):
                continue  # did not reach step s: not the timeline step s was restored from
            if s + 1 in before and _finite(before[s + 1]) and before[s + 1] != losses[s + 1]:
                out.append(
                    f"generation {g} resumed at {s}: loss {losses[s + 1]} at step {s + 1}, "
                    f"generation {g0} had {before[s + 1]}"
                )
            break
    return out


def _finite(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def extra_measures(job: Job) -> dict:
    """The kill scenarios' measurements beyond the common row."""
    printed: dict[int, list[float]] = {}  # step -> rank 0's prints of it (every generation)
    for log in (job.run_dir / "logs").glob("g[0-9]*/rank0.log"):
        for step, t in STEP_TIME.findall(log.read_text(errors="replace")):
            printed.setdefault(int(step), []).append(float(t))
    moments = []
    for m, phase in zip(job.moments, phase_of(job, job.moments), strict=True):
        before = [t for t in printed.get(m["step"], []) if t <= m["time"]]
        offset = f" +{m['time'] - max(before):.3f} s after its print" if before else ""
        moments.append(
            f"{m['victim']} of rank {m['rank']} ({m['node']}) at step {m['step']}{offset}: {phase}"
        )
    return {
        "moments": moments,
        "fresh_kills": sum(1 for m in job.moments if m.get("before_any_checkpoint")),
        "phases": phases(job, job.moments),
        **timeline(job.events()),
        "loss_mismatches": loss_mismatches(job),
    }


RESTART_EACH = {"--evict-window": "0", "--max-restarts": "40"}
OPTIONS = [word for pair in RESTART_EACH.items() for word in pair]
NO_WRONG_BYTES = {**NOTHING_LOST, "loss_mismatches": ("==", [])}
KILL_SCENARIOS = [
    Scenario(
        "worker_kill_ckpt",
        "a random rank's worker SIGKILLed at random moments around a save",
        "local",
        SHORT,
        kill_moments(("worker",)),
        {**NO_WRONG_BYTES, "restarts": ("==", "=kills"), "evictions": ("==", 0)},
        options=OPTIONS,
        measures=extra_measures,
    ),
    Scenario(
        "server_kill_ckpt",
        "a random rank's node's checkpoint server SIGKILLed at random moments around a save "
        "(the agent starts a new one; a restart only if a worker's save fails with it)",
        "local",
        SHORT,
        kill_moments(("server",)),
        {**NO_WRONG_BYTES, "restarts": ("<=", "=kills"), "evictions": ("==", 0)},
        options=OPTIONS,
        measures=extra_measures,
    ),
    Scenario(
        "agent_kill_ckpt",
        "a random rank's node's agent SIGKILLed at random moments around a save (the node dies "
        "with its workers and server; the spare replaces it, --refill-spares brings a new spare)",
        "local",
        SHORT,
        kill_moments(("agent",)),
        {**NO_WRONG_BYTES, "restarts": ("==", "=kills"), "evictions": ("==", "=kills")},
        options=[*OPTIONS, "--refill-spares"],
        measures=extra_measures,
    ),
    Scenario(
        "kill_mixed",
        "an elastic job (--nnodes 2:3, no spare, --refill-spares): a worker killed first, "
        "before any checkpoint where one is not saved every step (fresh start), a node's "
        "agent killed around a save (shrink to 2 nodes; a "
        "later restart grows back to 3), then workers, servers and agents at random moments "
        f"around saves, and a NaN at step {NAN_STEP} (rollback). Weights need not match the "
        "fault-free run (the world size changes); no load may be wrong, nothing left behind",
        "local",
        MIXED_STEPS,
        kill_moments(VICTIMS, mixed=True),
        {
            "succeeded": ("==", True),
            "wrong_loads": ("==", 0),
            "loss_mismatches": ("==", []),
            "leftovers": ("==", 0),
            "fresh_starts": (">=", "=fresh_kills"),
            "rollbacks": (">=", 1),
            "shrinks": (">=", 1),
        },
        options=[
            *OPTIONS,
            "--nnodes",
            "2:3",
            "--spares",
            "0",
            "--refill-spares",
            "--faults",
            f"nan@step={NAN_STEP}:rank=0",
        ],  # fmt: skip
        fault_step=1,
        timeout_s=300,
        measures=extra_measures,
    ),
]
