"""The report reads events.jsonl as typed `Event` records: a line that is not a valid event is
skipped (counted, logged, listed as unavailable), and the report is made of the rest, the same as
without it (the helpers are test_report.py's)."""

from __future__ import annotations

import json
import logging

import pytest
from test_report import T0, synthetic_events, write_synthetic_run

from transom.common.records import Event, EventKind
from transom.job_spec import ConfigError
from transom.report import build_summary, read_run
from transom.report.render import render_markdown

MALFORMED = [
    "{not json",  # not JSON
    json.dumps({"time": "x", "kind": "running", "message": "m", "generation": 2}),  # a wrong type
    json.dumps({"time": T0 + 9.5, "kind": "reboot", "message": "an unknown kind"}),
    json.dumps({"time": T0 + 9.6, "kind": "spare", "message": "m", "node": ["n3"]}),
    json.dumps([T0, "leader"]),  # JSON, but no object
    json.dumps({"kind": "leader", "message": "no time"}),  # a required field missing
]


def test_malformed_event_lines_are_skipped_and_the_rest_is_reported(tmp_path, caplog):
    clean = build_summary(read_run(write_synthetic_run(tmp_path / "clean")))
    run_dir = write_synthetic_run(tmp_path / "dirty")
    lines = [json.dumps(e) for e in synthetic_events()]
    lines[5:5] = MALFORMED[:3]  # in the middle: not only a torn last line
    lines += MALFORMED[3:]
    (run_dir / "events.jsonl").write_text("\n".join(lines) + "\n")

    with caplog.at_level(logging.WARNING, logger="transom.report.rundir"):
        records = read_run(run_dir)
    assert records.skipped_events == len(MALFORMED)
    assert len(records.events) == len(synthetic_events())
    assert all(isinstance(e, Event) and isinstance(e.kind, EventKind) for e in records.events)
    assert "skipped 6 line(s)" in caplog.text and "line 6: not JSON" in caplog.text

    dirty = build_summary(records)
    skipped = "6 line(s) of events.jsonl that are not valid events (skipped)"
    assert dirty["unavailable"] == [*clean["unavailable"], skipped]
    ignored = ("run_dir", "unavailable")
    assert {k: v for k, v in dirty.items() if k not in ignored} == {
        k: v for k, v in clean.items() if k not in ignored
    }
    assert dirty["fault_counts"] == {
        "total": 4,
        "recovered": 2,
        "not_recovered": 1,
        "not_detected": 1,
    }
    markdown = render_markdown(dirty)
    assert skipped in markdown
    assert markdown.replace(f"; {skipped}", "").replace(
        str(tmp_path / "dirty"), str(tmp_path / "clean")
    ) == render_markdown(clean)


def test_a_fault_event_is_read_with_its_extra_fields(tmp_path):
    """A fault's type and rank are not Event fields: they come from `extra`."""
    records = read_run(write_synthetic_run(tmp_path / "run"))
    (crash, *_) = (e for e in records.events if e.kind == EventKind.FAULT)
    assert crash.extra == {"fault": "crash", "rank": 1} and crash.node == "n1"
    (row, *_) = build_summary(records)["faults"]
    assert (row["type"], row["rank"], row["step"]) == ("crash", 1, 31)


def test_an_events_file_without_a_valid_event_is_refused_in_one_line(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "run")
    (run_dir / "events.jsonl").write_text("\n".join(MALFORMED) + "\n")
    with pytest.raises(ConfigError, match=r"has no valid event \(6 line\(s\) skipped\)"):
        read_run(run_dir)
