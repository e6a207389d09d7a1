"""A worker forked from the warm interpreter runs its script as `python -u SCRIPT ARGS` would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import wait_for

from transom.common import env as env_names
from transom.control import warm
from transom.control.warm import WarmPool
from transom.utils import idle_priority

SCRIPT = """
import json, os, sys
print(json.dumps({"name": __name__, "file": __file__, "argv": sys.argv, "cwd": os.getcwd(),
                  "rank": os.environ.get("RANK"), "path0": sys.path[0],
                  "torch_loaded": "torch" in sys.modules, "policy": os.sched_getscheduler(0),
                  "cores": sorted(os.sched_getaffinity(0)),
                  "autogroup": open("/proc/self/autogroup").read() if os.path.exists(
                      "/proc/self/autogroup") else None,
                  "idle_env": [k for k in os.environ if k.startswith("TRANSOM_WARM_IDLE")]}),
      flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "raise":
    raise ValueError("boom")
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def pool(tmp_path):
    pool = WarmPool(1, {**os.environ, "TRANSOM_WARM_IMPORTS": "json"}, tmp_path / "warm.log")
    pool.fill()
    yield pool
    pool.close()


def run_warm(pool: WarmPool, tmp_path, arg: str):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    wait_for(lambda: pool.warm_count() == 1, 30, "the interpreter to finish its imports")
    log = tmp_path / f"rank-{arg}.log"
    proc = pool.launch([str(script), arg], {**os.environ, "RANK": "7"}, log)
    assert proc is not None
    code = proc.wait(timeout=30)
    return code, log.read_text()


@pytest.mark.integration
def test_runs_the_script_as_main_with_its_env_argv_and_output(pool, tmp_path):
    code, text = run_warm(pool, tmp_path, "0")
    assert code == 0
    first = json.loads(text.splitlines()[0])
    assert first["name"] == "__main__"
    assert first["file"] == str(tmp_path / "job.py")
    assert first["argv"] == [str(tmp_path / "job.py"), "0"]
    assert first["rank"] == "7" and first["cwd"] == os.getcwd()
    assert first["path0"] == str(tmp_path)
    assert "to stderr" in text


@pytest.mark.integration
def test_exit_codes_and_tracebacks_are_those_of_a_plain_interpreter(pool, tmp_path):
    code, _ = run_warm(pool, tmp_path, "3")
    assert code == 3
    code, text = run_warm(pool, tmp_path, "raise")
    assert code == 1
    assert "Traceback" in text and "ValueError: boom" in text


@pytest.mark.integration
def test_one_interpreter_forks_every_worker_and_stays(pool, tmp_path):
    """Two workers at once, then another: all forked by the same interpreter, none importing."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    wait_for(lambda: pool.warm_count() == 1, 30, "the interpreter to finish its imports")
    interpreter = pool.interpreter
    assert interpreter is not None
    procs = [
        pool.launch([str(script), "0"], {**os.environ, "RANK": str(r)}, tmp_path / f"r{r}.log")
        for r in (0, 1)
    ]
    assert all(p is not None for p in procs) and pool.last_launch == "warm"
    assert len({p.pid for p in procs if p is not None} | {interpreter.pid}) == 3
    assert [p.wait(timeout=30) for p in procs if p is not None] == [0, 0]
    ranks = [
        json.loads((tmp_path / f"r{r}.log").read_text().splitlines()[0])["rank"] for r in (0, 1)
    ]
    assert ranks == ["0", "1"]
    pool.fill()
    assert pool.interpreter is interpreter and interpreter.poll() is None
    code, _ = run_warm(pool, tmp_path, "0")
    assert code == 0 and pool.interpreter is interpreter and pool.last_launch == "warm"


@pytest.mark.integration
def test_a_killed_worker_reports_its_signal_and_the_workers_die_with_the_interpreter(
    pool, tmp_path
):
    import psutil

    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    wait_for(lambda: pool.warm_count() == 1, 30, "the interpreter to finish its imports")
    first = pool.launch([str(script)], dict(os.environ), tmp_path / "a.log")
    second = pool.launch([str(script)], dict(os.environ), tmp_path / "b.log")
    assert first is not None and second is not None
    up = tmp_path / "a.log"
    wait_for(lambda: up.exists() and "up" in up.read_text(), 30, "the first worker to start")
    assert psutil.Process(first.pid).ppid() == pool.interpreter.pid
    assert os.getsid(first.pid) == first.pid  # a session of its own, as a cold worker's
    first.kill()
    assert first.wait(timeout=30) == -signal.SIGKILL
    assert second.poll() is None
    pool.interpreter.kill()  # the interpreter dies: its workers with it, never orphans
    assert second.wait(timeout=30) == -signal.SIGKILL
    assert not psutil.pid_exists(second.pid) or psutil.Process(second.pid).status() == "zombie"
    pool.fill()  # a new interpreter replaces the dead one
    assert run_warm(pool, tmp_path, "0")[0] == 0


@pytest.mark.integration
def test_a_worker_first_run_after_its_interpreter_died_exits_before_the_script(tmp_path):
    """The child checks its parent against the pid that forked it, taken before the fork: one
    first scheduled after the interpreter died (reparented meanwhile) never runs the script."""
    ran = tmp_path / "ran"
    script = tmp_path / "x.py"
    script.write_text(f"open({str(ran)!r}, 'w').close()\n")
    job = {"env": {}, "argv": [str(script)], "log": str(tmp_path / "l"), "cwd": str(tmp_path)}
    become = "import json, os; from transom.control import warm; "
    become += "warm._become_worker(json.loads(os.environ['JOB']), 1)"  # "forked" by pid 1
    orphan = subprocess.run(
        [sys.executable, "-c", become], env={**os.environ, "JOB": json.dumps(job)}, timeout=60
    )
    assert orphan.returncode == 1 and not ran.exists() and not (tmp_path / "l").exists()


def test_an_empty_pool_hands_out_nothing(tmp_path):
    pool = WarmPool(1, dict(os.environ), tmp_path / "warm.log")
    assert pool.launch([sys.executable], dict(os.environ), tmp_path / "x.log") is None


@pytest.mark.integration
@pytest.mark.skipif(
    not idle_priority.can_leave(),
    reason="may not leave SCHED_IDLE here (not root, RLIMIT_NICE < 20)",
)
def test_imports_run_at_idle_priority_then_the_interpreter_and_workers_at_normal(tmp_path):
    """The imports run at SCHED_IDLE, on any core, their session's autogroup (where the kernel
    has them) niced to 19; once they are done, the interpreter waits (and forks) at the normal
    policy, nice 0, on the agent's cores, and so do its workers."""
    gate = tmp_path / "go"
    (tmp_path / "gated_import.py").write_text(
        f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.02)\n"
    )
    env = {
        **os.environ,
        "TRANSOM_WARM_IMPORTS": "json,gated_import",
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    pool = WarmPool(1, env, tmp_path / "warm.log")
    every_core = set(range(os.cpu_count() or 1))
    mine = os.sched_getaffinity(0)
    agent_cores = {min(mine)}  # an agent confined to one core, as beside isolated ranks
    os.sched_setaffinity(0, agent_cores)
    try:
        pool.fill()
    finally:
        os.sched_setaffinity(0, mine)
    try:
        interpreter = pool.interpreter
        assert interpreter is not None
        # Whether the kernel groups sessions, asked of the interpreter (a session of its own): a
        # test run from init's session has no autogroup of its own to read (an empty file).
        grouped = idle_priority.autogroup_nice(interpreter.pid) is not None
        wait_for(
            lambda: (
                os.sched_getscheduler(interpreter.pid) == os.SCHED_IDLE
                and os.sched_getaffinity(interpreter.pid) == every_core
                and (not grouped or idle_priority.autogroup_nice(interpreter.pid) == 19)
            ),
            30,
            "the interpreter to import at idle priority, on every core",
        )
        gate.touch()
        wait_for(lambda: pool.warm_count() == 1, 30, "the interpreter to finish its imports")
        assert os.sched_getscheduler(interpreter.pid) == os.SCHED_OTHER
        assert os.sched_getaffinity(interpreter.pid) == agent_cores
        assert idle_priority.autogroup_nice(interpreter.pid) == (0 if grouped else None)
        code, text = run_warm(pool, tmp_path, "0")
        first = json.loads(text.splitlines()[0])
        assert code == 0 and first["policy"] == os.SCHED_OTHER and first["idle_env"] == []
        assert first["cores"] == sorted(agent_cores)
        assert not grouped or first["autogroup"].split()[-1] == "0"
    finally:
        pool.close()


@pytest.mark.integration
def test_a_worker_handed_over_before_its_imports_are_done_runs_at_normal_priority(tmp_path):
    pool = WarmPool(1, {**os.environ, "TRANSOM_WARM_IMPORTS": "json"}, tmp_path / "warm.log")
    pool.fill()
    try:
        script = tmp_path / "job.py"
        script.write_text(SCRIPT)
        proc = pool.launch([str(script), "0"], {**os.environ, "RANK": "7"}, tmp_path / "early.log")
        assert proc is not None and proc.wait(timeout=30) == 0
        assert (
            json.loads((tmp_path / "early.log").read_text().splitlines()[0])["policy"]
            == os.SCHED_OTHER
        )
    finally:
        pool.close()


TITLE_SCRIPT = """
import sys
with open("/proc/self/cmdline", "rb") as f:
    print(f.read().replace(b"\\0", b" ").decode().strip(), flush=True)
"""


@pytest.mark.integration
def test_ps_shows_a_waiting_interpreter_then_the_workers_script_and_arguments(tmp_path):
    import psutil

    env = {**os.environ, env_names.WARM_IMPORTS: "json", env_names.JOB_ID: "job-7"}
    pool = WarmPool(1, env, tmp_path / "warm.log", node_id="node3")
    pool.fill()
    try:
        wait_for(lambda: pool.warm_count() == 1, 30, "the interpreter to finish its imports")
        assert pool.interpreter is not None
        waiting = " ".join(psutil.Process(pool.interpreter.pid).cmdline())
        assert "transom warm interpreter (job job-7, node node3)" in waiting
        script = tmp_path / "train.py"
        script.write_text(TITLE_SCRIPT)
        log = tmp_path / "rank0.log"
        proc = pool.launch([str(script), "--steps", "5"], dict(env), log)
        assert proc is not None and proc.wait(timeout=30) == 0
        title = log.read_text().splitlines()[0]
        assert title == f"{sys.executable} -u {script} --steps 5"
    finally:
        pool.close()


@pytest.mark.integration
def test_an_interpreter_that_fails_a_launch_is_retired_until_its_workers_end(
    pool, tmp_path, monkeypatch
):
    """The interpreter stops answering after forking one worker: the next launch is given up
    (that worker starts cold), the running worker is left alone, the job forked late exits
    before its script, and the old interpreter ends once its worker has."""
    monkeypatch.setattr(warm, "FORK_REPLY_S", 1.0)
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    wait_for(lambda: pool.warm_count() == 1, 30, "the interpreter to finish its imports")
    first = pool.launch([str(script)], dict(os.environ), tmp_path / "a.log")
    assert first is not None
    up = tmp_path / "a.log"
    wait_for(lambda: up.exists() and "up" in up.read_text(), 30, "the first worker to start")
    old = pool.interpreter
    assert old is not None
    old.send_signal(signal.SIGSTOP)
    try:
        assert pool.launch([str(script)], dict(os.environ), tmp_path / "b.log") is None
        assert pool.interpreter is None and [i.proc for i in pool.retired] == [old]
        assert first.poll() is None and old.poll() is None  # the worker runs on
    finally:
        old.send_signal(signal.SIGCONT)
    # Continued, it forks the job it was sent: that worker exits before running the script.
    wait_for(lambda: pool.read_messages(0.1) or pool.retired[0].unwanted, 30, "the late fork")
    assert not (tmp_path / "b.log").exists()
    first.kill()
    assert first.wait(timeout=30) == -signal.SIGKILL  # reported by the retired interpreter
    wait_for(lambda: pool.read_messages(0.1) or not pool.retired, 30, "the retired one to end")
    assert old.poll() is not None
    assert not list(tmp_path.glob(".warm-cancelled-*"))  # its marker went with it
    pool.fill()
    assert run_warm(pool, tmp_path, "0")[0] == 0
