"""The run report: what happened in one run, how much of its time went into training, and whether
its final model is the one a fault-free run computes.

`write_report(run_dir)` (and `transom report RUN_DIR`) writes report.png (timeline), report.md and
report.json into the run directory (or `out_dir`) and returns the JSON summary, a dict with these
top-level keys (times are unix seconds, durations `*_s`, ratios `*_x`; None where unavailable):

  job_id        the job's id (from status.json), or None
  run_dir       the run directory, as given
  outcome       {state: SUCCEEDED|FAILED|..., reason, finished, generations, restarts}
  start_at      the run's first event
  end_at        its succeeded/failed event (its last record if it did not finish)
  goodput       {wall_s, steps_completed, effective_training_s, effective_ratio_x, startup_s,
                 downtime_s, lost_compute_s, shutdown_s, lost_steps, reference_wall_s, slowdown_x,
                 progress_available, launch_s}; launch_s is the launcher's time before the first
                 event (etcd, imports, the agents), not in wall_s (None when status.json has no
                 `launched_at`)
  faults        one dict per injected fault: {id, type, node, rank, step, generation, injected_at,
                 detected_by, detected_at, detection_s, detected_step, recovered_in_generation,
                 running_at, recovered_at, recovery_s, lost_steps, status}; status is
                 "detected+recovered", "detected, not recovered" or "not detected"; detected_step
                 is the step the detecting event names (None if it names none)
  fault_counts  {total, recovered, not_recovered, not_detected}
  generations   one dict per generation: {generation, started_at, running_at, trained_at, members,
                 spares, restore_step, reached_step}
  incidents     one dict per generation that a next one followed: {generation, next_generation,
                 cause, interrupted_step, interrupted_at, restore_step, lost_steps, trains_again_at}
  weights       {available, note, identical, tensors, differing: [{name, differing_elements, numel,
                 max_abs_diff, note}], missing, extra, summary}; max_abs_diff is "nan" when a NaN
                 differs; summary is the check in one line
  text          a few plain lines summing the report up, for a terminal
  unavailable   what the run lacked (no progress.jsonl, no weights, no reference.json), and
                 the lines of events.jsonl skipped as not valid events, if any
  files         {png, markdown, json}: the paths written

The definitions of every number are in `transom.report.analysis`; the events are read as
`transom.common.records.Event` records (`transom.report.rundir`). This package must never change
a run's records: it only adds the three report files.
"""

from __future__ import annotations

import json
from pathlib import Path

from transom.report.analysis import analyse, generations
from transom.report.membership import membership
from transom.report.render import render_markdown, render_text, weights_line
from transom.report.rundir import (
    EVENTS_FILE,
    FINAL_WEIGHTS_FILE,
    PROGRESS_FILE,
    REFERENCE_FILE,
    REFERENCE_WEIGHTS_FILE,
    RunRecords,
    read_run,
)

PNG_FILE = "report.png"
MARKDOWN_FILE = "report.md"
JSON_FILE = "report.json"

__all__ = ["build_summary", "write_report", "render_markdown", "read_run"]


def _weights(records: RunRecords) -> dict:
    absent = [
        name
        for name, path in (
            (FINAL_WEIGHTS_FILE, records.final_weights),
            (REFERENCE_WEIGHTS_FILE, records.reference_weights),
        )
        if path is None
    ]
    if absent:
        return {
            "available": False,
            "note": f"no {' and no '.join(absent)} in the run directory",
            "identical": None,
            "tensors": None,
            "differing": [],
            "missing": [],
            "extra": [],
        }
    from transom.report.weights import compare_files  # torch is slow to import: only when needed

    assert records.final_weights is not None and records.reference_weights is not None
    return {
        "available": True,
        "note": "",
        **compare_files(records.final_weights, records.reference_weights),
    }


def build_summary(records: RunRecords) -> dict:
    """The JSON summary of a run (see the module docstring for its keys); writes nothing."""
    summary = {
        "job_id": records.job_id,
        "run_dir": str(records.run_dir),
        **analyse(records.events, records.progress, records.status, records.reference),
    }
    summary["weights"] = _weights(records)
    summary["weights"]["summary"] = weights_line(summary["weights"])
    summary["unavailable"] = [
        what
        for what, missing in (
            (f"training progress ({PROGRESS_FILE})", records.progress is None),
            (
                f"the weights check ({FINAL_WEIGHTS_FILE}, {REFERENCE_WEIGHTS_FILE})",
                not summary["weights"]["available"],
            ),
            (f"the fault-free reference time ({REFERENCE_FILE})", records.reference is None),
            (
                f"{records.skipped_events} line(s) of {EVENTS_FILE} that are not valid events "
                "(skipped)",
                records.skipped_events > 0,
            ),
        )
        if missing
    ]
    summary["text"] = render_text(summary)
    return summary


def write_report(run_dir: Path | str, out_dir: Path | str | None = None) -> dict:
    """Write report.png, report.md and report.json for `run_dir`; return the JSON summary.

    Raises transom.job_spec.ConfigError (a one-line message) when `run_dir` is no run directory."""
    from transom.report.timeline import draw_timeline  # matplotlib: only when drawing

    records = read_run(run_dir)
    out = Path(out_dir) if out_dir is not None else records.run_dir
    out.mkdir(parents=True, exist_ok=True)
    summary = build_summary(records)
    summary["files"] = {
        "png": str(out / PNG_FILE),
        "markdown": str(out / MARKDOWN_FILE),
        "json": str(out / JSON_FILE),
    }
    gens = generations(records.events, records.progress)
    draw_timeline(
        out / PNG_FILE,
        summary,
        gens,
        membership(records.events, records.progress, summary["end_at"]),
    )
    (out / MARKDOWN_FILE).write_text(render_markdown(summary, PNG_FILE))
    (out / JSON_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary
