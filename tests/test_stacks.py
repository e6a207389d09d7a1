"""How a stuck rank's stack is said in one line (transom.monitor.stacks): the library call and
the script's line, and ranks in the same place together, stopped ones first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
from conftest import wait_for

from transom.common import env
from transom.monitor import stacks


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        (
            [
                ("/x/site-packages/torch/distributed/distributed_c10d.py", 10, "all_reduce"),
                ("/x/site-packages/torch/distributed/c10d_logger.py", 5, "wrapper"),
                ("/home/u/train.py", 57, "<module>"),
            ],
            "in all_reduce at train.py:57",
        ),
        (
            [
                ("/x/site-packages/torch/autograd/graph.py", 8, "_engine_run_backward"),
                ("/x/site-packages/torch/autograd/__init__.py", 7, "backward"),
                ("/x/site-packages/torch/_tensor.py", 6, "backward"),
                ("/x/site-packages/transformers/trainer.py", 5, "train"),
                ("/home/u/train_hf.py", 73, "<module>"),
            ],
            "in backward, from train at train_hf.py:73",
        ),
        ([("/home/u/train.py", 9, "loop")], "at train.py:9 in loop"),
        ([("/x/site-packages/torch/a.py", 3, "f")], "in f at a.py:3"),
        ([], "no Python stack"),
    ],
)
def test_where_names_the_library_call_and_the_scripts_line(frames, expected):
    assert stacks.where([stacks.Frame(*f) for f in frames]) == expected


def test_group_where_puts_ranks_in_the_same_place_together():
    text = stacks.group_where(
        {2: "in all_reduce at t.py:5", 1: "stopped", 0: "in all_reduce at t.py:5"}
    )
    assert text == "rank 1: stopped; ranks 0, 2: in all_reduce at t.py:5"


@pytest.mark.integration
def test_the_collector_names_a_stopped_and_a_gone_rank_and_says_when_it_is_done(tmp_path):
    stopped = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    done = threading.Event()
    try:
        os.kill(stopped.pid, signal.SIGSTOP)  # delivered asynchronously: wait for it to hold
        wait_for(lambda: stacks.process_state(stopped.pid) == stacks.STOPPED, 10, "the stop")
        collector = stacks.StackCollector(done=done.set)
        ranks = {0: (stopped.pid, tmp_path / "rank0.stacks"), 1: (gone.pid, tmp_path / "r1")}
        assert collector.request(("g1", 7), ranks, "train.py")
        assert done.wait(10), "the collector never said it was done"
        found = collector.results(("g1", 7))
        assert found == stacks.Collection({0: stacks.STOPPED, 1: stacks.GONE}, frozenset())
        assert not collector.request(("g1", 7), ranks, "train.py")  # once per stuck step
    finally:
        stopped.kill()
        stopped.wait()


CHURN = """
import sys, threading, time
from transom.control import bootstrap
assert bootstrap.register_stack_dump()


def churn():  # threads that start and end all the time (a checkpoint's helpers, a reporter)
    while True:
        t = threading.Thread(target=lambda: sum(range(100)))
        t.start()
        t.join()


def wait_in_main():
    time.sleep(600)


threading.Thread(target=churn, daemon=True).start()
print("ready", flush=True)
wait_in_main()
"""


@pytest.mark.integration
def test_many_dumps_leave_a_rank_whose_threads_come_and_go_alive(tmp_path):
    """150 dumps of a rank whose other threads start and end threads all the time: the rank
    lives on (dumping every thread killed such a rank by SIGSEGV once in about 70 dumps), and
    each dump is of the main thread, where the script waits."""
    script = tmp_path / "churn.py"
    script.write_text(CHURN)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        env={**os.environ, env.STACKS_DIR: str(tmp_path), "RANK": "0"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        target = {0: (proc.pid, tmp_path / "rank0.stacks")}

        def place() -> str:
            return stacks.where(stacks.dump_many(target, str(script), timeout_s=5).get(0, []))

        waiting = "at churn.py:15 in wait_in_main"
        wait_for(lambda: place() == waiting or proc.poll() is not None, 10, "its wait")
        for n in range(150):
            found = place()
            assert proc.poll() is None, f"the rank died ({proc.returncode}) at dump {n}"
            assert found == waiting, (n, found)
    finally:
        proc.kill()
        proc.wait()
