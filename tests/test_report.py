"""The run report: exact numbers on hand-made run directories, the weights check, files, CLI.

The synthetic run (`write_synthetic_run`) is small enough to check every number by hand:

  t=1000 leader; 1002 generation 1 (n0, n1; spare n2) starts fresh; progress 10, 20, 30 at 1004-1006
  1006.5 crash on n1 rank 1, seen at 1006.75; 1008 generation 2 restores step 20;
         progress 25, 35, 45 at 1010-1012
  1012.2 n0 killed, found lost at 1015.0; n0 evicted, spare n2 joins;
         1015.2 generation 3 restores 40;
         progress 50, 60 at 1017, 1018
  1017.5 n2 made slow: a straggler seen at 1017.8, answered with a warning only
  1017.6 a log fault on n1 that nothing detects; 1018.5 succeeded
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import zlib
from pathlib import Path

import pytest
import torch
from conftest import REPO

from transom.cli import main
from transom.report import build_summary, read_run, write_report
from transom.report.analysis import NOT_DETECTED, NOT_RECOVERED, RECOVERED
from transom.report.membership import membership
from transom.report.render import weights_line
from transom.report.weights import compare_files

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXAMPLE = str(REPO / "examples" / "train_gpt.py")
DATA = Path(__file__).resolve().parent / "data"
T0 = 1000.0


def ev(t: float, kind: str, message: str = "", **fields) -> dict:
    return {"time": T0 + t, "kind": kind, "message": message or kind, **fields}


def synthetic_events() -> list[dict]:
    return [
        ev(0.0, "leader", generation=0),
        ev(2.0, "generation", generation=1, members=["n0", "n1"], spares=["n2"], restore_step=None),
        ev(3.0, "running", generation=1),
        ev(6.5, "fault", fault="crash", generation=1, id="f0", node="n1", rank=1, step=31),
        ev(
            6.9,
            "anomaly",
            "crash: rank 1 killed by SIGKILL",
            observed=T0 + 6.75,
            id="n1-1-1",
            type="crash",
            severity="critical",
            nodes=["n1"],
            ranks=[1],
            generation=1,
        ),
        ev(7.0, "incident", "n1 reported a failure", generation=1, lost=[], failed=["n1"]),
        ev(
            7.2,
            "diagnosis",
            "generation 1: n1: rank 1 killed by SIGKILL; blamed: n1",
            generation=1,
            blamed=["n1"],
            cause="n1: rank 1 killed by SIGKILL; blamed: n1",
            lost=[],
            detection=T0 + 7.0,
        ),
        ev(8.0, "generation", generation=2, members=["n0", "n1"], spares=["n2"], restore_step=20),
        ev(9.0, "running", generation=2),
        ev(12.2, "fault", fault="kill", generation=2, id="f1", node="n0", rank=0, step=46),
        ev(15.0, "incident", "n0 lost", generation=2, lost=["n0"], failed=[]),
        ev(
            15.1,
            "diagnosis",
            "generation 2: n0 lost; blamed: n0",
            generation=2,
            blamed=["n0"],
            cause="n0 lost; blamed: n0",
            lost=["n0"],
            detection=T0 + 15.0,
        ),
        ev(
            15.1,
            "evict",
            "n0 evicted: node lost: its lease expired",
            generation=2,
            node="n0",
            lost=["n0"],
        ),
        ev(15.1, "spare", "spare n2 joins the job", generation=2, node="n2"),
        ev(15.2, "generation", generation=3, members=["n1", "n2"], spares=[], restore_step=40),
        ev(16.0, "running", generation=3),
        ev(17.5, "fault", fault="slow", generation=3, id="f2", node="n2", rank=0, step=55),
        ev(17.6, "fault", fault="log", generation=3, id="f3", node="n1", rank=1, step=56),
        ev(
            17.9,
            "anomaly",
            "straggler: n2",
            observed=T0 + 17.8,
            id="s1",
            type="straggler",
            severity="warning",
            nodes=["n2"],
            ranks=[0],
            generation=3,
        ),
        ev(
            17.9,
            "warning",
            "straggler (n2); no spare to replace it",
            generation=3,
            anomaly="s1",
            nodes=["n2"],
        ),
        ev(18.5, "succeeded", "all 2 nodes finished generation 3", generation=3),
    ]


def synthetic_progress() -> list[dict]:
    samples = [
        (4.0, 1, 10),
        (5.0, 1, 20),
        (6.0, 1, 30),
        (9.5, 2, None),
        (10.0, 2, 25),
        (11.0, 2, 35),
        (12.0, 2, 45),
        (17.0, 3, 50),
        (18.0, 3, 60),
    ]
    members = {1: ["n0", "n1"], 2: ["n0", "n1"], 3: ["n1", "n2"]}
    return [
        {
            "time": T0 + t,
            "state": "RUNNING",
            "generation": g,
            "step": step,
            "members": members[g],
            "spares": ["n2"] if g < 3 else [],
            "evicted": ["n0"] if g == 3 else [],
        }
        for t, g, step in samples
    ]


def write_lines(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_synthetic_run(run_dir: Path, progress: bool = True) -> Path:
    run_dir.mkdir(parents=True)
    write_lines(run_dir / "events.jsonl", synthetic_events())
    if progress:
        write_lines(run_dir / "progress.jsonl", synthetic_progress())
    (run_dir / "status.json").write_text(
        json.dumps({"job_id": "job-synthetic", "job": {"state": "SUCCEEDED"}})
    )
    (run_dir / "reference.json").write_text(
        json.dumps({"wall_s": 9.25, "steps": 60, "command": ["x"]})
    )
    return run_dir


def tiny_model() -> dict:
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(4, 3),
        "head.bias": torch.zeros(3),
        "step": torch.tensor(60),
    }


def test_goodput_numbers_are_exact(tmp_path):
    s = build_summary(read_run(write_synthetic_run(tmp_path / "run")))
    g = s["goodput"]
    # kept steps: g1 up to 20 (g2 restores 20), g2 up to 40 (g3 restores 40), g3 all 60;
    # g2 reached step 40 halfway between its samples of 35 (t=11) and 45 (t=12). The faults count
    # as samples: g1 reached step 31 at 6.5 (the crash), g2 step 46 at 12.2 (the kill).
    assert g["wall_s"] == pytest.approx(18.5)
    assert g["steps_completed"] == 60
    assert g["effective_training_s"] == pytest.approx(1.0 + 1.5 + 1.0)
    assert g["effective_ratio_x"] == pytest.approx(3.5 / 18.5)
    assert g["startup_s"] == pytest.approx(4.0)
    assert g["lost_compute_s"] == pytest.approx((6.5 - 5.0) + (12.2 - 11.5))
    assert g["downtime_s"] == pytest.approx((10.0 - 6.5) + (17.0 - 12.2))
    assert g["shutdown_s"] == pytest.approx(0.5)
    assert g["lost_steps"] == (31 - 20) + (46 - 40)
    assert g["reference_wall_s"] == 9.25 and g["slowdown_x"] == pytest.approx(2.0)
    parts = (
        g["effective_training_s"]
        + g["startup_s"]
        + g["lost_compute_s"]
        + g["downtime_s"]
        + g["shutdown_s"]
    )
    assert parts == pytest.approx(g["wall_s"])
    assert s["outcome"] == {
        "state": "SUCCEEDED",
        "reason": "all 2 nodes finished generation 3",
        "finished": True,
        "generations": 3,
        "restarts": 2,
    }
    assert [
        (i["interrupted_step"], i["restore_step"], i["lost_steps"]) for i in s["incidents"]
    ] == [(31, 20, 11), (46, 40, 6)]
    assert s["incidents"][1]["cause"] == "n0 lost; blamed: n0"


def test_a_generation_trains_from_when_its_step_was_reached_not_when_the_launcher_wrote_it(
    tmp_path,
):
    # Generation 3's first sample was written at 17.0 for a step its nodes' agents saw reached at
    # 16.4: the 0.6 s between is training, not downtime. A step_at later than the record's own
    # time (an agent's clock ahead) or not a number is the record's time, as before step_at was.
    run_dir = write_synthetic_run(tmp_path / "run")
    progress = synthetic_progress()
    progress[7]["step_at"] = T0 + 16.4
    progress[4]["step_at"] = T0 + 99.0  # generation 2's first sample: ahead, so 10.0 stands
    progress[5]["step_at"] = "soon"
    write_lines(run_dir / "progress.jsonl", progress)
    g = build_summary(read_run(run_dir))["goodput"]
    assert g["downtime_s"] == pytest.approx((10.0 - 6.5) + (16.4 - 12.2))
    assert g["effective_training_s"] == pytest.approx(1.0 + 1.5 + 1.6)


def test_a_generation_trains_from_its_first_step_not_from_its_first_progress_record(tmp_path):
    # Generation 2's first record (10.0) shows step 25, but its members' statuses said they had
    # all finished step 21, their first, by 9.7: the 0.3 s between is training, not downtime.
    # A first step that is not a number, or without a time, is no sample.
    run_dir = write_synthetic_run(tmp_path / "run")
    before = build_summary(read_run(run_dir))["goodput"]
    progress = synthetic_progress()
    progress[4].update(first_step=21, first_step_at=T0 + 9.7)
    progress[5].update(first_step="21", first_step_at=T0 + 9.0)
    progress[6].update(first_step=21, first_step_at=None)
    write_lines(run_dir / "progress.jsonl", progress)
    g = build_summary(read_run(run_dir))["goodput"]
    assert g["downtime_s"] == pytest.approx(before["downtime_s"] - 0.3)
    assert g["effective_training_s"] == pytest.approx(before["effective_training_s"] + 0.3)


def test_the_launch_before_the_first_event_is_shown_and_not_counted_in_the_wall_time(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "run")
    before = build_summary(read_run(run_dir))
    assert before["goodput"]["launch_s"] is None  # no launched_at: unknown
    status = {"job_id": "job-synthetic", "job": {"state": "SUCCEEDED"}, "launched_at": T0 - 2.5}
    (run_dir / "status.json").write_text(json.dumps(status))
    s = build_summary(read_run(run_dir))
    assert s["goodput"]["launch_s"] == pytest.approx(2.5)
    assert s["goodput"]["wall_s"] == before["goodput"]["wall_s"]
    assert "(launched 2.5 s before)" in s["text"].splitlines()[0]
    for forged in ("soon", True, T0 + 1.0):  # not a number, or after the first event
        (run_dir / "status.json").write_text(json.dumps({**status, "launched_at": forged}))
        assert build_summary(read_run(run_dir))["goodput"]["launch_s"] is None


def test_a_step_every_rank_saved_is_a_sample_at_the_last_save(tmp_path):
    # Generation 3's ranks both saved step 60 by 17.6 (the progress record of 60 came at 18.0):
    # the job ended 0.9 s after its last step, not 0.5 s. A step one rank alone saved (61) is
    # no sample, nor a save without a rank.
    run_dir = write_synthetic_run(tmp_path / "run")
    saved = [
        ev(17.5, "checkpoint", action="saved", step=60, rank=0, node="n1"),
        ev(17.6, "checkpoint", action="saved", step=60, rank=1, node="n2"),
        ev(17.7, "checkpoint", action="saved", step=61, rank=0, node="n1"),
        ev(17.8, "checkpoint", action="saved", step=62, node="n1"),
    ]
    events = sorted(synthetic_events() + saved, key=lambda e: e["time"])
    write_lines(run_dir / "events.jsonl", events)
    g = build_summary(read_run(run_dir))["goodput"]
    assert g["shutdown_s"] == pytest.approx(18.5 - 17.6)
    assert g["effective_training_s"] == pytest.approx(1.0 + 1.5 + 0.6)


def test_a_last_step_known_only_after_the_end_is_timed_at_the_generations_pace(tmp_path):
    # The final status brought step 62 in a record written at 18.9, after the job's end (18.5),
    # and no save timed it: generation 3 made 10 steps a second, so 62 came at 18.2.
    run_dir = write_synthetic_run(tmp_path / "run")
    progress = synthetic_progress()
    progress.append({**progress[-1], "time": T0 + 18.9, "state": "SUCCEEDED", "step": 62})
    write_lines(run_dir / "progress.jsonl", progress)
    g = build_summary(read_run(run_dir))["goodput"]
    assert g["steps_completed"] == 62
    assert g["shutdown_s"] == pytest.approx(18.5 - 18.2)
    assert g["effective_training_s"] == pytest.approx(1.0 + 1.5 + 1.2)


def test_a_generation_resumes_from_the_step_its_ranks_restored_not_the_plans(tmp_path):
    # The plan of generation 2 names step 20 (the catalog's newest when it was made); its ranks
    # agreed on step 30, the newest they all held: one step lost, not eleven.
    run = write_synthetic_run(tmp_path / "run")
    restored = [
        ev(9.2, "checkpoint", action="restored", step=30, rank=r, tier="memory") for r in (0, 1)
    ]
    events = sorted(synthetic_events() + restored, key=lambda e: e["time"])
    write_lines(run / "events.jsonl", events)
    s = build_summary(read_run(run))
    assert [(i["restore_step"], i["lost_steps"]) for i in s["incidents"]] == [(30, 1), (40, 6)]
    assert s["goodput"]["lost_steps"] == 1 + 6


def test_each_fault_is_matched_to_its_detection_and_recovery(tmp_path):
    s = build_summary(read_run(write_synthetic_run(tmp_path / "run")))
    crash, kill, slow, log = s["faults"]
    assert crash["detected_by"] == "crash anomaly" and crash["detection_s"] == pytest.approx(0.25)
    assert crash["recovered_in_generation"] == 2 and crash["running_at"] == T0 + 9.0
    assert crash["recovered_at"] == T0 + 10.0 and crash["recovery_s"] == pytest.approx(3.25)
    assert crash["lost_steps"] == 11 and crash["status"] == RECOVERED
    assert kill["detected_by"] == "node lost" and kill["detection_s"] == pytest.approx(2.8)
    assert kill["recovered_at"] == T0 + 17.0 and kill["recovery_s"] == pytest.approx(2.0)
    assert kill["lost_steps"] == 6 and kill["status"] == RECOVERED
    assert slow["detected_by"] == "straggler anomaly" and slow["detection_s"] == pytest.approx(0.3)
    assert slow["status"] == NOT_RECOVERED and slow["recovery_s"] is None
    assert log["status"] == NOT_DETECTED and log["detected_at"] is None
    assert s["fault_counts"] == {"total": 4, "recovered": 2, "not_recovered": 1, "not_detected": 1}


def test_a_crash_without_its_anomaly_is_detected_by_the_incident(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "run")
    write_lines(
        run_dir / "events.jsonl", [e for e in synthetic_events() if e.get("type") != "crash"]
    )
    crash = build_summary(read_run(run_dir))["faults"][0]
    assert crash["detected_by"] == "worker failure (incident)" and crash[
        "detection_s"
    ] == pytest.approx(0.5)
    assert crash["status"] == RECOVERED and crash["recovery_s"] == pytest.approx(3.0)


def test_nan_is_detected_at_its_earliest_step_and_rollback_counts_as_recovery(tmp_path):
    events = [
        ev(0.0, "generation", generation=1, members=["n0", "n1"], spares=[], restore_step=None),
        ev(1.0, "running", generation=1),
        ev(5.0, "fault", fault="nan", generation=1, id="f0", node="n1", rank=1, step=40),
        ev(
            5.4,
            "anomaly",
            observed=T0 + 5.3,
            id="late",
            type="nan",
            nodes=["n0"],
            ranks=[0],
            step=41,
        ),
        ev(
            5.5,
            "anomaly",
            observed=T0 + 5.35,
            id="first",
            type="nan",
            nodes=["n1"],
            ranks=[1],
            step=40,
        ),
        ev(
            5.6,
            "decision",
            "rollback",
            action="rollback",
            anomaly="first",
            anomaly_type="nan",
            nodes=["n1"],
        ),
        ev(6.0, "generation", generation=2, members=["n0", "n1"], spares=[], restore_step=30),
        ev(7.0, "running", generation=2),
        ev(9.0, "succeeded"),
    ]
    progress = [
        {"time": T0 + t, "generation": g, "step": step}
        for t, g, step in [(2.0, 1, 10), (5.5, 1, 42), (7.5, 2, 30), (8.0, 2, 31), (8.5, 2, 50)]
    ]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_lines(run_dir / "events.jsonl", events)
    write_lines(run_dir / "progress.jsonl", progress)
    s = build_summary(read_run(run_dir))
    (nan,) = s["faults"]
    assert nan["detected_at"] == T0 + 5.35 and nan["detection_s"] == pytest.approx(0.35)
    # a sample at the restore step itself is not training again: step 31 at t=8.0 is
    assert (
        nan["recovered_at"] == T0 + 8.0 and nan["lost_steps"] == 12 and nan["status"] == RECOVERED
    )
    assert s["goodput"]["steps_completed"] == 50
    assert s["job_id"] is None and s["unavailable"]


@pytest.mark.integration
def test_a_run_without_progress_or_weights_still_gets_a_report(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "run", progress=False)
    s = write_report(run_dir)
    g = s["goodput"]
    assert g["wall_s"] == pytest.approx(18.5) and g["progress_available"] is False
    assert (
        g["effective_training_s"] is None
        and g["lost_steps"] is None
        and g["steps_completed"] is None
    )
    crash = s["faults"][0]
    assert crash["status"] == RECOVERED and crash["recovered_at"] == T0 + 9.0  # the `running` event
    assert not s["weights"]["available"]
    assert any("progress.jsonl" in u for u in s["unavailable"])
    markdown = (run_dir / "report.md").read_text()
    assert "unavailable: the run has no progress.jsonl" in markdown
    assert "Unavailable: no final_weights.pt and no reference_weights.pt" in markdown


def test_an_unfinished_run_ends_at_its_last_record(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "run")
    write_lines(
        run_dir / "events.jsonl", [e for e in synthetic_events() if e["kind"] != "succeeded"]
    )
    (run_dir / "status.json").write_text(json.dumps({"job_id": "j", "job": {"state": "RUNNING"}}))
    s = build_summary(read_run(run_dir))
    assert s["outcome"]["state"] == "RUNNING" and s["outcome"]["finished"] is False
    assert (
        s["end_at"] == T0 + 18.0 and s["goodput"]["shutdown_s"] == 0.0
    )  # the last progress sample


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's header chunk, after checking the signature and its CRC."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16 : 16 + length]
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(kind + body)
    assert data.endswith(b"IEND\xaeB`\x82"), "truncated PNG"
    return struct.unpack(">II", body[:8])


@pytest.mark.integration
def test_write_report_writes_png_markdown_and_json(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "run")
    torch.save(tiny_model(), run_dir / "final_weights.pt")
    torch.save(tiny_model(), run_dir / "reference_weights.pt")
    s = write_report(run_dir, tmp_path / "out")
    width, height = png_size(tmp_path / "out" / "report.png")
    assert width > 800 and height > 400
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == s
    assert set(s) == {
        "job_id",
        "run_dir",
        "outcome",
        "start_at",
        "end_at",
        "goodput",
        "faults",
        "fault_counts",
        "generations",
        "incidents",
        "weights",
        "unavailable",
        "text",
        "files",
    }
    assert s["weights"]["identical"] is True and s["weights"]["tensors"] == 3
    assert s["weights"]["summary"] == "bit-identical to the fault-free run (3 tensors)"
    assert s["text"].splitlines() == [
        "SUCCEEDED after 18.5 s; the fault-free run took 9.2 s (2.00x)",
        "60 steps, 17 lost to faults; effective training 3.5 s = 19% of wall time",
        "faults: 2 of 4 detected and recovered",
        "  fault    step node    detected by         recovered  lost  status",
        "  crash      31 n1        0.25 s crash         3.25 s    11  detected+recovered",
        "  kill       46 n0        2.80 s node lost     2.00 s     6  detected+recovered",
        "  slow       55 n2        0.30 s straggler          -     -  detected, not recovered",
        "  log        56 n1             - -                  -     -  not detected",
        "weights: bit-identical to the fault-free run (3 tensors)",
    ]
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "**Bit-identical**" in markdown and "| f1 | kill | n0 / 0 |" in markdown
    assert "effective-training-time ratio | 0.189 |" in markdown
    assert not (run_dir / "report.md").exists()


def test_weights_check_names_each_differing_tensor(tmp_path):
    final, reference = tiny_model(), tiny_model()
    final["embed.weight"][1, 2] += 0.5
    final["head.bias"][0] = -0.0  # equal by value, not by bits
    final["extra.buffer"] = torch.ones(2)
    del final["step"]
    torch.save(final, tmp_path / "final.pt")
    torch.save(reference, tmp_path / "reference.pt")
    result = compare_files(tmp_path / "final.pt", tmp_path / "reference.pt")
    assert result["identical"] is False
    by_name = {d["name"]: d for d in result["differing"]}
    assert set(by_name) == {"embed.weight", "head.bias"}
    assert (
        by_name["embed.weight"]["differing_elements"] == 1
        and by_name["embed.weight"]["numel"] == 12
    )
    assert by_name["embed.weight"]["max_abs_diff"] == pytest.approx(0.5, abs=1e-6)
    assert (
        by_name["head.bias"]["differing_elements"] == 1
        and by_name["head.bias"]["max_abs_diff"] == 0.0
    )
    assert result["missing"] == ["step"] and result["extra"] == ["extra.buffer"]
    assert weights_line({"available": True, **result}) == (
        "2 of 3 tensors differ from the fault-free run; largest difference 0.5 in embed.weight; "
        "1 missing; 1 extra"
    )


def test_weights_check_is_strict_about_nan_and_dtype(tmp_path):
    reference = {"w": torch.tensor([1.0, math.nan]), "h": torch.ones(2, dtype=torch.float32)}
    torch.save(reference, tmp_path / "reference.pt")
    torch.save(
        {"w": torch.tensor([1.0, math.nan]), "h": torch.ones(2, dtype=torch.float32)},
        tmp_path / "same.pt",
    )
    assert (
        compare_files(tmp_path / "same.pt", tmp_path / "reference.pt")["identical"] is True
    )  # same NaN bits
    torch.save(
        {"w": torch.tensor([math.nan, math.nan]), "h": torch.ones(2, dtype=torch.float64)},
        tmp_path / "other.pt",
    )
    result = compare_files(tmp_path / "other.pt", tmp_path / "reference.pt")
    by_name = {d["name"]: d for d in result["differing"]}
    assert by_name["w"]["max_abs_diff"] == "nan" and by_name["w"]["differing_elements"] == 1
    assert "float64" in by_name["h"]["note"] and by_name["h"]["differing_elements"] is None
    json.dumps(result, allow_nan=False)  # the summary stays valid JSON


@pytest.mark.integration
def test_cli_refuses_a_directory_without_events(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert main(["report", str(tmp_path)]) == 2
    assert main(["report"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 3
        and "does not exist" in err[0]
        and "no events.jsonl" in err[1]
        and "RUN_DIR" in err[2]
    )


def test_cli_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["report", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and all(
        option in out for option in ("RUN_DIR", "--out", "--json", "--run-dir")
    )


@pytest.mark.integration
def test_cli_prints_the_markdown_or_the_json(tmp_path, capsys):
    run_dir = write_synthetic_run(tmp_path / "run")
    assert main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out == (run_dir / "report.md").read_text()
    assert main(["report", "--run-dir", str(run_dir), "--json", "--out", str(tmp_path / "o")]) == 0
    assert json.loads(capsys.readouterr().out)["fault_counts"]["recovered"] == 2
    assert (tmp_path / "o" / "report.png").exists()


@pytest.mark.integration
def test_report_of_a_recorded_demo_run(tmp_path):
    """tests/data/demo-run: the records of a real `transom demo --steps 160` (main at 51389fb):
    4 nodes + 1 spare, a crash, a node death, a hang, a NaN and a slow node, every one recovered,
    then the fault-free torchrun reference (reference.json). Its diagnosis and evict events were
    given the structured fields the controller writes since (`cause`, `lost`), taken from their
    messages once, when the report stopped reading messages."""
    run_dir = shutil.copytree(DATA / "demo-run", tmp_path / "run")
    s = write_report(run_dir)
    assert s["outcome"]["state"] == "SUCCEEDED" and s["outcome"]["restarts"] == 5
    assert [
        (f["type"], f["status"], f["recovered_in_generation"], f["lost_steps"]) for f in s["faults"]
    ] == [
        ("crash", RECOVERED, 2, 0),
        ("kill", RECOVERED, 3, 7),
        ("hang", RECOVERED, 4, 15),
        ("nan", RECOVERED, 5, 20),
        ("slow", RECOVERED, 6, 12),
    ]
    assert [f["detected_by"] for f in s["faults"]] == [
        "crash anomaly",
        "node lost",
        "hang anomaly",
        "nan anomaly",
        "straggler anomaly",
    ]
    assert [round(f["detection_s"], 2) for f in s["faults"]] == [0.22, 2.74, 8.07, 0.12, 2.26]
    assert [round(f["recovery_s"], 2) for f in s["faults"]] == [5.62, 3.26, 1.86, 7.32, 2.28]
    g = s["goodput"]
    assert g["steps_completed"] == 160 and g["lost_steps"] == 54
    assert g["wall_s"] == pytest.approx(72.15, abs=0.01) and g[
        "effective_ratio_x"
    ] == pytest.approx(0.205, abs=1e-3)  # 0.242 before checkpoint saves timed its steps
    assert g["reference_wall_s"] == 15.543 and g["slowdown_x"] == pytest.approx(
        72.15 / 15.543, abs=0.01
    )
    lanes = membership(read_run(run_dir).events, read_run(run_dir).progress, s["end_at"])
    assert [span[2] for span in lanes["node3"]][-1] == "evicted" and lanes["node4"][-1][
        2
    ] == "member"
    assert png_size(run_dir / "report.png")[0] > 800


@pytest.mark.slow
def test_report_of_a_real_run_with_a_crash(start_job, tmp_path):
    """A real two-node job with a crash: the report finds the crash, its detection, the recovery."""
    job = start_job(
        "--nnodes",
        "2",
        "--max-restarts",
        "2",
        "--faults",
        "crash@step=12:rank=1",
        EXAMPLE,
        "--steps",
        "30",
        "--ckpt-every",
        "5",
    )
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    copy = shutil.copytree(
        job.run_dir, tmp_path / "copy", ignore=shutil.ignore_patterns("etcd", "checkpoints")
    )
    s = write_report(copy)
    assert s["outcome"]["state"] == "SUCCEEDED" and s["outcome"]["restarts"] == 1
    (crash,) = s["faults"]
    assert crash["type"] == "crash" and crash["rank"] == 1 and crash["status"] == RECOVERED
    assert 0 < crash["detection_s"] < 10 and 0 < crash["recovery_s"] < 60
    png_size(copy / "report.png")
