"""What a launcher keeps of its job for people, and how it follows the job record.

`RunMirror` follows every key of the job through one watch (store/prefix_mirror.py) and keeps,
in the launcher's run directory: `status.json` (the newest snapshot, what `transom status` reads
after the job), `progress.jsonl` (the job's progress each time it changed) and `events.jsonl`
(every event once); it prints the events worth a person's attention and feeds the live view. It
writes the files when something changed (or every PROBE_S, so that status.json's time stays
recent), and takes the job record as the other launchers do (below), but reads it directly
only when its watch heard nothing from etcd for PROBE_S (a running job's summaries are heard
several times a second), so a job where nothing happens costs its launcher one read every
PROBE_S. One launcher of a job needs it: on a job of a
thousand machines (a Slurm step: one launcher each) a mirror on every one would make etcd send
every node's summaries to every node, half a million events a second, so the other launchers
follow the job record alone (`JobFollower`: pushed by a watch, and read directly now and then,
so that etcd's silence is still counted as an outage). The mirror keeps no event once written:
a job's events grow with every save (three a node), and each rewrite walks the copy.

It only reads etcd, and writes nothing but the run directory's files and the console.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.live import Live

from transom.common import files, keys
from transom.store import Store
from transom.store.key_follow import KeyFollower
from transom.store.prefix_mirror import PrefixMirror
from transom.view import (
    EventFilter,
    format_event,
    progress_record,
    render_live,
    snapshot_of,
    status_summary,
)

# A launcher without a mirror reads the job record directly this often: its answer is the
# evidence that etcd is reachable (the watch of a stalled etcd is silent, not broken).
PROBE_S = 5.0


class JobFollower:
    """The job record alone, for a launcher without a mirror: pushed by a watch, and read
    directly every PROBE_S (StoreError then is the launcher's outage)."""

    def __init__(self, store: Store) -> None:
        self.job = KeyFollower(store, keys.JOB)

    def stop(self) -> None:
        self.job.stop()

    def value(self, now: float, heard_at: float = -math.inf) -> Any:
        """The job record's newest value (StoreError if a direct read fails); read directly
        unless etcd was heard within PROBE_S (here, or at `heard_at` by another watch)."""
        self.job.start_once(now)
        if now - max(self.job.heard_at, heard_at) >= PROBE_S:
            self.job.read(now)
        return self.job.refresh(now)


@functools.cache
def _launched_at() -> float:
    return psutil.Process().create_time()


def with_launch(snap: dict) -> dict:
    """`snap` with `launched_at`, when this launcher process started: the run report shows the
    launch before the controller's first event (etcd, the template's imports, the agents)."""
    return {**snap, "launched_at": _launched_at()}


# A progress record's times: a record that differs only in these is not written again.
TIMES = ("time", "step_at", "first_step_at")


class RunMirror:
    """The job's keys, followed, written into `run_dir` and shown on `console`."""

    def __init__(self, store: Store, run_dir: Path, console: Console, total_steps: int | None):
        self.store, self.run_dir, self.console = store, run_dir, console
        self.total_steps = total_steps
        self.watch = PrefixMirror(store)
        self.job = JobFollower(store)
        self._events_seen: set[str] = set()
        self._event_filter = EventFilter()
        self._last_progress: dict | None = None
        # The newest generation whose members all finished a step (None: none seen yet).
        self.trained_generation: int | None = None
        self._shown: tuple[int, Any] | None = None  # (mirror revision, job record) last written
        self._shown_at = -math.inf

    def stop(self) -> None:
        self.watch.stop()
        self.job.stop()

    def value(self, now: float) -> Any:
        """The job record's newest value (StoreError if a direct read fails)."""
        return self.job.value(now, self.watch.heard_at)

    def show(self, now: float, job_value: Any, terminal: bool, live: Live | None) -> None:
        """Take in what changed and write it (StoreError if etcd cannot be read). `job_value`:
        the job record's newest value; `terminal`: the job ended, so every event written before
        it is read directly (the watch may lag)."""
        self.watch.start_once(now)
        self.watch.refresh(now)
        shown = (self.watch.revision, job_value)
        if shown == self._shown and not terminal and now - self._shown_at < PROBE_S:
            return
        self._shown, self._shown_at = shown, now
        snap = snapshot_of(self.store.job_id, self.watch.values | {keys.JOB: job_value})
        final = self.store.get_prefix(keys.EVENTS) if terminal else None
        self._write(snap, self._new_events(final), live)

    def _new_events(self, read: dict[str, dict] | None = None) -> list[dict]:
        """Events not mirrored yet: those the watch delivered, or those of a direct `read`."""
        if read is None:
            put = [n for n in self.watch.take_put() if n.startswith(keys.EVENTS)]
            read = {n[len(keys.EVENTS) :]: self.watch.values[n] for n in put}
            self.watch.forget(put)  # written once: the copy keeps the state, not the history
        new = []
        for key, event in read.items():
            if key not in self._events_seen:
                self._events_seen.add(key)
                new.append(event)
        return new

    def _write(self, snap: dict, new: list[dict], live: Live | None) -> None:
        # Compact: json's C encoder serves no indent (a third of the time, twice a second). The
        # launcher writes the job's last snapshot indented when it ends.
        compact = json.dumps(with_launch(snap), separators=(",", ":"))
        (self.run_dir / files.STATUS).write_text(compact)
        record = progress_record(snap)
        if record is not None:
            if record["step"] is not None:
                self.trained_generation = record["generation"]
            shown = {k: v for k, v in record.items() if k not in TIMES}
            if shown != self._last_progress:
                self._last_progress = shown
                with open(self.run_dir / files.PROGRESS, "a") as f:
                    f.write(json.dumps(record) + "\n")
        if new:
            with open(self.run_dir / files.EVENTS, "a") as f:
                for event in new:
                    f.write(json.dumps(event) + "\n")
        for event in sorted(new, key=lambda e: e["time"]):
            if self._event_filter.shown(event):
                self.console.print(format_event(event), highlight=False, markup=False)
        if live is not None:
            live.update(render_live(status_summary(snap), self.total_steps))
