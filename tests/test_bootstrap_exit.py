"""A worker's script that raises, exits or finishes ends as Python would, less the teardown.

The bootstrap (`python -m transom.control.bootstrap SCRIPT`, the cold-start path; the warm path
calls the same `run_script`) prints the traceback, waits for the threads that are not daemons,
runs the atexit functions, flushes open files and exits with status 1, but skips the teardown,
where destroying a process group with a dead peer took 1-2 s before the agent could report the
failure. A script that finishes or chooses its exit is ended the same way (the teardown of
torch's modules took 1.2 s between a job's last step and its end), its namespace finalized as the
teardown of `__main__` would.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import atexit, sys, threading, time

class Teardown:
    def __del__(self):
        print("teardown ran", flush=True)

kept = Teardown()
log = open(sys.argv[2], "w")  # left open, as scripts do: its buffered lines must reach the file
log.write("logged before the failure\\n")
atexit.register(lambda: print("atexit ran", flush=True))

def late():
    time.sleep(0.3)
    print("thread finished", flush=True)

threading.Thread(target=late).start()
try:
    if sys.argv[1] == "raise":
        raise RuntimeError("peer died")
    if sys.argv[1] == "text":
        sys.exit("gave up: no data")
    if sys.argv[1] != "finish":
        sys.exit(int(sys.argv[1]))
finally:
    print("finally ran", flush=True)
"""


def run(tmp_path, arg: str, bootstrap: bool = True) -> tuple[int, str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    log = tmp_path / "own.log"
    log.unlink(missing_ok=True)
    prefix = ["-m", "transom.control.bootstrap"] if bootstrap else []
    done = subprocess.run(
        [sys.executable, "-u", *prefix, str(script), arg, str(log)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TRANSOM_AUTO_MONITOR": "0"},
    )
    assert log.read_text() == "logged before the failure\n"
    return done.returncode, done.stdout + done.stderr


@pytest.mark.integration
def test_a_failing_script_runs_its_finally_threads_and_atexit_then_exits_1_without_teardown(
    tmp_path,
):
    code, out = run(tmp_path, "raise", bootstrap=False)  # plain Python, for comparison
    assert code == 1 and "teardown ran" in out
    code, out = run(tmp_path, "raise")
    assert code == 1
    assert "Traceback" in out and "RuntimeError: peer died" in out
    lines = out.splitlines()
    assert lines.index("finally ran") < lines.index("thread finished") < lines.index("atexit ran")
    assert "teardown ran" not in out


@pytest.mark.integration
def test_an_exit_the_script_chose_is_pythons_own(tmp_path):
    code, out = run(tmp_path, "3")
    assert code == 3
    assert "teardown ran" in out and "atexit ran" in out and "Traceback" not in out


@pytest.mark.integration
def test_a_script_that_finishes_or_exits_with_a_message_ends_as_plain_python_does(tmp_path):
    for arg in ("finish", "text"):
        plain = run(tmp_path, arg, bootstrap=False)
        code, out = run(tmp_path, arg)
        assert code == plain[0] == (0 if arg == "finish" else 1)
        lines = out.splitlines()
        assert (
            lines.index("finally ran") < lines.index("thread finished") < lines.index("atexit ran")
        )
        assert lines.index("atexit ran") < lines.index("teardown ran")  # __main__ after atexit
        assert ("gave up: no data" in out) == (arg == "text") == ("gave up: no data" in plain[1])


@pytest.mark.integration
def test_flushing_files_at_the_exit_reads_no_attribute_of_the_scripts_objects(tmp_path):
    """Some objects intercept every attribute read (torch.distributed's deprecated `reduce_op`
    warns on each): the files are found by their type, never by asking an object its class."""
    script = tmp_path / "job.py"
    script.write_text(
        "class Noisy:\n"
        "    def __getattribute__(self, name):\n"
        "        print('read', name, flush=True)\n"
        "        return object.__getattribute__(self, name)\n"
        "kept = [Noisy()]\n"
        "print('done', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-u", "-m", "transom.control.bootstrap", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TRANSOM_AUTO_MONITOR": "0"},
    )
    assert done.returncode == 0 and done.stdout.splitlines() == ["done"], done.stdout
