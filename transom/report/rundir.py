"""Reading a finished (or stopped) run directory into records for the report.

A run directory holds `events.jsonl` (required: without it there is nothing to report),
`status.json`, `progress.jsonl` (the launcher's training-progress samples), and, after
`transom demo`, `final_weights.pt`, `reference_weights.pt` and `reference.json`. Parts that are
missing are `None` here; the report marks them unavailable.

Each line of events.jsonl is parsed here, once, into a `transom.common.records.Event`: the file
crossed a process boundary, so a line that is not JSON or not a valid event (a wrong type, an
unknown kind) is skipped, counted in `RunRecords.skipped_events` and logged, and the report is
made of the rest. The other files stay plain dicts.

This module only reads: it must never write into the run directory or interpret the records.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from transom.common import files
from transom.common.records import Event, RecordError
from transom.job_spec import ConfigError

# What a run directory holds (defined in transom.common.files).
EVENTS_FILE = files.EVENTS
PROGRESS_FILE = files.PROGRESS
STATUS_FILE = files.STATUS
REFERENCE_FILE = files.REFERENCE
FINAL_WEIGHTS_FILE = files.FINAL_WEIGHTS
REFERENCE_WEIGHTS_FILE = files.REFERENCE_WEIGHTS

log = logging.getLogger(__name__)


@dataclass
class RunRecords:
    """Everything the report is computed from, as read from one run directory."""

    run_dir: Path
    events: list[Event]  # time order
    status: dict | None
    progress: list[dict] | None  # time order; None when the run has no progress.jsonl
    reference: dict | None  # the fault-free run's {"wall_s", "steps", "command"}
    final_weights: Path | None
    reference_weights: Path | None
    skipped_events: int = 0  # lines of events.jsonl that were not valid events

    @property
    def job_id(self) -> str | None:
        return (self.status or {}).get("job_id")


def _json_lines(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file; a torn last line (run killed mid-write) is skipped."""
    records = []
    lines = path.read_text(errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if number == len(lines):
                break
            raise ConfigError(f"{path}: line {number} is not JSON") from None
    return records


def _events(path: Path) -> tuple[list[Event], int]:
    """The valid events of an events.jsonl in time order, and how many lines were not (not JSON,
    or not an `Event`: skipped, the first reason logged)."""
    events: list[Event] = []
    skipped, first = 0, ""
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            events.append(Event.from_dict(json.loads(line)))
        except (ValueError, RecursionError) as e:  # RecordError is a ValueError, as json's is
            why = str(e) if isinstance(e, RecordError) else "not JSON"
            skipped, first = skipped + 1, first or f"line {number}: {why}"
    if skipped:
        log.warning("%s: skipped %d line(s) that are not valid events (%s)", path, skipped, first)
    return sorted(events, key=lambda e: e.time), skipped


def _json_file(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise ConfigError(f"{path} is not JSON") from None


def read_run(run_dir: Path | str) -> RunRecords:
    """The run's records, or ConfigError (one line) when `run_dir` is not a run directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist")
    events_path = run_dir / EVENTS_FILE
    if not events_path.exists():
        raise ConfigError(
            f"{run_dir} has no {EVENTS_FILE}: not a transom run directory, the job never "
            f"started, or {files.NOT_MIRRORED}"
        )
    events, skipped = _events(events_path)
    if not events:
        raise ConfigError(
            f"{events_path} has no valid event ({skipped} line(s) skipped)"
            if skipped
            else f"{events_path} is empty: the job never started"
        )
    progress_path = run_dir / PROGRESS_FILE
    progress = (
        sorted(_json_lines(progress_path), key=lambda p: p.get("time", 0.0))
        if progress_path.exists()
        else None
    )

    def optional(name: str) -> Path | None:
        return run_dir / name if (run_dir / name).exists() else None

    return RunRecords(
        run_dir=run_dir,
        events=events,
        status=_json_file(run_dir / STATUS_FILE),
        progress=progress or None,
        reference=_json_file(run_dir / REFERENCE_FILE),
        final_weights=optional(FINAL_WEIGHTS_FILE),
        reference_weights=optional(REFERENCE_WEIGHTS_FILE),
        skipped_events=skipped,
    )
