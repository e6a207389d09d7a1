"""The command line: bad input is refused with one clear line and starts nothing; --help explains."""

from __future__ import annotations

import subprocess
import sys

from conftest import TOY


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
    for expected, args in cases.items():
        run_dir = ["--run-dir", str(tmp_path / "r")] if "--run-dir" not in args else []
        out = subprocess.run(
            [sys.executable, "-m", "transom", "run", *run_dir, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, (expected, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (expected, out.stderr)
        assert not (tmp_path / "r" / "logs").exists(), f"{expected}: something was started"


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


def test_help_explains_every_command():
    for command in ("run", "demo", "agent", "controller", "status", "events"):
        out = subprocess.run(
            [sys.executable, "-m", "transom", command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "usage: transom " + command in out.stdout


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
    }
    for expected, args in cases.items():
        out = subprocess.run(
            [sys.executable, "-m", "transom", *args], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2, (expected, out.stderr)
        assert expected in out.stderr.strip(), (expected, out.stderr)
    assert not (tmp_path / "d" / "logs").exists()
