"""What a torture trial measured: one row per trial, from the job's events, logs and weights.

  succeeded          the job ended SUCCEEDED (launcher exit 0, or the job record's state)
  restarts           the job record's restarts_used
  evictions          nodes the controller evicted, or set aside for a spare as dead (their lease
                     not yet expired when the job ended: transom.control.set_aside)
  steps_lost         steps trained twice: for each generation after the first, the last step
                     the previous generation's rank 0 completed minus the step this one resumed at
  wrong_loads        ranks that resumed at a step their generation may not resume at: another
                     step than most of its ranks, one below the plan's step (TRANSOM_RESTORE_STEP,
                     0 for a fresh start; ranks restore the newest step every one of them holds,
                     which may be newer), or, after a NaN, one at or after the poisoned step
  unverified_loads   ranks of generations whose plan no event recorded (the launcher died first)
  restored_tiers     where the ranks of later generations restored from (memory, peer, storage)
  identical          final weights bit for bit those of the fault-free reference
  leftover_procs     processes of the job alive 10 s after it ended by itself
  leftover_shm       its /dev/shm entries then
`ExitWatch` timestamps processes' exits (for the fencing timeline of a cut-off node).
This module only reads; it never signals a process.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

from transom.common import files
from transom.report.weights import compare_files

RESUMED = re.compile(r"\[train_gpt\] resumed step=(\d+) rank=(\d+)")
RESTORED = re.compile(r"\[train_gpt\] restored step=(\d+) rank=(\d+) tier=(\w+)")
STEP = re.compile(r"^step (\d+) ", re.M)


def generations(run_dir: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in (run_dir / files.LOGS).glob("g[0-9]*") if p.is_dir())


def steps_lost(run_dir: Path) -> int:
    lost, previous_last = 0, None
    for g in generations(run_dir):
        log = files.rank_log(run_dir, g, 0)
        if not log.exists():
            continue
        text = log.read_text(errors="replace")
        resumed = [int(m.group(1)) for m in RESUMED.finditer(text)]
        steps = [int(s) for s in STEP.findall(text)]
        if not resumed:
            continue
        if previous_last is not None:
            lost += max(0, previous_last - resumed[0])
        previous_last = max(steps, default=resumed[0])
    return lost


def loads(run_dir: Path, events: list[dict]) -> tuple[int, int, dict[str, int]]:
    """(wrong loads, unverified loads, restored tiers counted) over every generation that started
    ranks (see the module's text); a load is unverified when no event of the run records its
    generation's plan."""
    floor: dict[int, int] = {}
    before: dict[int, int] = {}  # generation -> the step it must resume before (a rollback)
    rollback = None
    for e in sorted(events, key=lambda e: e.get("time") or 0):
        if e.get("kind") == "rollback" and isinstance(e.get("rollback_before"), int):
            rollback = e["rollback_before"]
        elif e.get("kind") == "generation" and isinstance(e.get("generation"), int):
            floor[e["generation"]] = e.get("restore_step") or 0
            if rollback is not None:
                before[e["generation"]], rollback = rollback, None
    wrong, unverified, tiers = 0, 0, {}
    for g in generations(run_dir):
        resumed = []
        for log in files.generation_logs(run_dir, g).glob("rank*.log"):
            text = log.read_text(errors="replace")
            resumed += [int(m.group(1)) for m in RESUMED.finditer(text)]
            for m in RESTORED.finditer(text):
                tiers[m.group(3)] = tiers.get(m.group(3), 0) + 1
        if g not in floor:
            unverified += len(resumed)
            continue
        if not resumed:
            continue
        common = Counter(resumed).most_common(1)[0][0]
        allowed = common >= floor[g] and common < before.get(g, common + 1)
        wrong += sum(1 for s in resumed if s != common or not allowed)
    return wrong, unverified, tiers


def measure(job, reference: Path, succeeded: bool, leftovers: dict) -> dict:
    record = job.final_record()
    events = job.events()
    wrong, unverified, tiers = loads(job.run_dir, events)
    identical = None
    if job.final.exists():
        identical = compare_files(job.final, reference)["identical"]
    return {
        "job_id": job.job_id,
        "succeeded": succeeded,
        "restarts": record.get("restarts_used"),
        "evictions": len(set(record.get("evicted") or {}) | set(record.get("set_aside") or {})),
        "steps_lost": steps_lost(job.run_dir),
        "wrong_loads": wrong,
        "unverified_loads": unverified,
        "restored_tiers": tiers,
        "identical": identical,
        "leftover_procs": leftovers["processes"],
        "leftover_shm": leftovers["shm"],
        "seconds": round(time.time() - job.started, 1),
    }


class ExitWatch:
    """Records when each watched process last ran (time.time(), polled every 20 ms): when it
    exited, or when it was frozen (SIGSTOP: it runs no further instruction) if it never ran
    again afterwards (a frozen process later killed ran nothing after the freeze)."""

    def __init__(self, pids: list[int]):
        self.exits: dict[int, float | None] = {pid: None for pid in pids}
        self._procs = {}
        for pid in pids:
            try:
                self._procs[pid] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                self.exits[pid] = time.time()
        self._gone: set[int] = set()
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="exit-watch").start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for pid, proc in self._procs.items():
                if pid in self._gone:
                    continue
                try:
                    status = proc.status()
                except psutil.NoSuchProcess:
                    status = psutil.STATUS_ZOMBIE
                if status == psutil.STATUS_ZOMBIE:
                    self._gone.add(pid)
                if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED):
                    self.exits[pid] = self.exits[pid] or time.time()
                else:
                    self.exits[pid] = None  # running (again)

    def last_exit(self) -> float | None:
        """When the last watched process last ran (None while one still runs)."""
        if any(t is None for t in self.exits.values()):
            return None
        return max(self.exits.values(), default=None)  # type: ignore[type-var]

    def stop(self) -> None:
        self._stop.set()
