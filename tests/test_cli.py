"""The command line: bad input is refused with one clear line and starts nothing; --help
explains."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import TOY


@pytest.mark.integration
def test_bad_input_is_refused_before_anything_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = {
        "script not found": ["--nnodes", "2", str(tmp_path / "missing.py")],
        "at least 1 node": ["--nnodes", "0", str(TOY)],
        "more spares than active nodes": ["--nnodes", "2", "--spares", "5", str(TOY)],
        "cannot reach etcd": ["--store", "http://127.0.0.1:1", "--job-id", "x", str(TOY)],
        "cannot be written": ["--run-dir", str(blocker / "run"), str(TOY)],
        "expected N or MIN:MAX": ["--nnodes", "two", str(TOY)],
    }
    # All at once: "cannot reach etcd" waits out the store's deadline, the others do not wait.
    procs = {}
    try:
        for expected, args in cases.items():
            run_dir = ["--run-dir", str(tmp_path / "r")] if "--run-dir" not in args else []
            procs[expected] = subprocess.Popen(
                [sys.executable, "-m", "transom", "run", *run_dir, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        for expected, p in procs.items():
            _, stderr = p.communicate(timeout=60)
            assert p.returncode == 2, (expected, stderr)
            lines = stderr.strip().splitlines()
            assert len(lines) == 1 and expected in lines[0], (expected, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not (tmp_path / "r" / "logs").exists(), "something was started"


@pytest.mark.integration
def test_status_and_events_need_a_source(tmp_path):
    for command in ("status", "events"):
        out = subprocess.run(
            [sys.executable, "-m", "transom", command], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2 and "--run-dir" in out.stderr
        out = subprocess.run(
            [sys.executable, "-m", "transom", command, "--run-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and "not a transom run directory" in out.stderr


@pytest.mark.integration
def test_help_explains_every_command():
    for command in ("run", "demo", "agent", "controller", "status", "events"):
        out = subprocess.run(
            [sys.executable, "-m", "transom", command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "usage: transom " + command in out.stdout


@pytest.mark.integration
def test_bad_demo_and_refill_input_is_refused(tmp_path):
    cases = {
        "at least 80 steps": ["demo", "--run-dir", str(tmp_path / "d"), "--steps", "10"],
        "cannot be used with --store": [
            "run",
            "--store",
            "http://127.0.0.1:1",
            "--job-id",
            "x",
            "--refill-spares",
            str(TOY),
        ],
        "--controllers 0: at least 1": ["run", "--controllers", "0", str(TOY)],
        "--controllers -1: at least 1": [
            *("run", "--store", "http://127.0.0.1:1", "--job-id", "x"),
            *("--controllers", "-1", str(TOY)),
        ],
        "--no-mirror is for one machine of a multi-machine job": ["run", "--no-mirror", str(TOY)],
    }
    for expected, args in cases.items():
        out = subprocess.run(
            [sys.executable, "-m", "transom", *args], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2, (expected, out.stderr)
        assert expected in out.stderr.strip(), (expected, out.stderr)
    assert not (tmp_path / "d" / "logs").exists()


# -- in-process checks of the parsers (no processes, no etcd) --------------------------------------


def _job_flags(parser, command: str) -> set[str]:
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {s for a in sub._actions for s in a.option_strings}


def test_run_and_controller_take_every_job_option():
    from transom.cli import build_parser
    from transom.job_spec import job_options

    parser = build_parser()
    flags = {opt.flag for _, opt in job_options()}
    assert {"--no-warm-workers", "--warmup-timeout", "--settle-time", "--hang-floor"} <= flags
    assert flags <= _job_flags(parser, "run")
    assert flags <= _job_flags(parser, "controller")


def test_run_and_controller_build_the_same_spec():
    from transom.cli import build_parser, spec_from_args

    options = ["--nnodes", "2:3", "--spares", "1", "--no-warm-workers", "--hang-floor", "20"]
    store = ["--store", "http://127.0.0.1:1", "--job-id", "j1"]
    parser = build_parser()
    specs = [
        spec_from_args(
            parser.parse_args([command, *store, *options, "train.py", "--lr", "1"]), False
        )
        for command in ("run", "controller")
    ]
    assert specs[0] == specs[1]
    assert specs[0].warm_workers is False and specs[0].hang_floor_s == 20.0
    assert specs[0].script_args == ["--lr", "1"] and specs[0].job_id == "j1"


BAD_IDS = [
    ["run", "--job-id", "bad/id", str(TOY)],
    ["run", "--node-id", "has space", str(TOY)],
    ["agent", "--store", "http://127.0.0.1:1", "--job-id", "j", "--node-id", "../up"],
    ["agent", "--store", "http://127.0.0.1:1", "--job-id=-j", "--node-id", "n"],
    ["controller", "--store", "http://127.0.0.1:1", "--job-id", "j", "--candidate-id", "c/1"],
    ["status", "--store", "http://127.0.0.1:1", "--job-id", "a" * 65],
    ["events", "--store", "http://127.0.0.1:1", "--job-id", "j*"],
    ["demo", "--job-id", ".hidden"],
]


@pytest.mark.parametrize("argv", BAD_IDS, ids=lambda argv: argv[0])
def test_a_bad_id_is_refused_with_one_line(argv, capsys, tmp_path, monkeypatch):
    from transom.cli import main

    monkeypatch.chdir(tmp_path)  # a command that got past the check would write here
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use letters, digits" in err[0], err
    assert err[0].split()[1] in ("--job-id", "--node-id", "--candidate-id"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]"])
def test_a_wildcard_host_is_refused_with_one_line(host, capsys, tmp_path, monkeypatch):
    from transom.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["agent", "--store", "http://127.0.0.1:1", "--job-id", "j", "--host", host]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "wildcard address" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_too_many_simulated_nodes_is_refused(capsys, tmp_path, monkeypatch):
    from transom.cli import main
    from transom.job_spec import MAX_SIMULATED_NODES

    monkeypatch.chdir(tmp_path)
    n = MAX_SIMULATED_NODES + 1
    assert main(["run", "--nnodes", str(n), str(TOY)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{n} simulated nodes" in err[0], err
    assert main(["run", "--nnodes", str(n - 1), "--spares", "2", str(TOY)]) == 2
    assert f"{n + 1} simulated nodes" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
