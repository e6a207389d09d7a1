"""A rank at work outside a step is told apart from one that waits (transom.monitor.busy): from
two looks, on made-up looks and on real processes of each shape, waits of three kinds included
(a blocking call, a spin inside one call, a polling loop)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import wait_for

from transom.common import env
from transom.monitor import busy, stacks

A = (("/u/train.py", 10, "main"),)
B = (("/u/train.py", 11, "main"),)


def look(t, stack, main, children):
    return busy.Look(t, stack, main, children)


@pytest.mark.parametrize(
    ("looks", "expected"),
    [
        ([look(0.0, A, 1.0, 0.0), look(0.25, B, 1.2, 0.0)], True),  # moved and ran
        ([look(0.0, A, 1.0, 0.0), look(0.1, A, 1.1, 0), look(0.25, B, 1.2, 0)], True),  # later
        ([look(0.0, A, 1.0, 0.0), look(0.25, A, 1.25, 0.0)], False),  # a spin inside a call
        ([look(0.0, A, 1.0, 0.0), look(0.25, B, 1.01, 0.0)], False),  # a polling loop
        ([look(0.0, A, 1.0, 0.0), look(0.25, A, 1.0, 0.1)], True),  # its children ran
        ([look(0.0, A, 1.0, 0.0), look(0.25, A, 1.0, 0.01)], False),  # ... hardly
        ([look(0.0, A, None, None), look(0.25, B, None, None)], False),  # unreadable
        ([look(0.0, (), 1.0, 0.0), look(0.25, B, 1.2, 0.0)], False),  # no first stack
        ([look(0.25, A, 1.0, 0.0), look(0.25, B, 1.2, 0.0)], False),  # no time between
        ([look(0.0, A, 1.0, 0.0)], False),  # one look
        ([look(0.0, A + B, 1.0, 0.0), look(0.25, A, 1.2, 0.0)], False),  # a dump cut short
        ([look(0.0, A + B, 1.0, 0.0), look(0.25, B + B, 1.2, 0.0)], True),  # as deep, moved
    ],
)
def test_working_needs_a_moving_stack_that_runs_or_children_that_run(looks, expected):
    assert busy.working(looks) is expected


@pytest.mark.integration
def test_a_process_that_cannot_be_read_has_no_cpu_time():
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    assert busy.main_thread_cpu_s(gone.pid) is None
    assert busy.children_cpu_s(gone.pid) is None


SHAPES = """
import os, sys, time
from transom.control import bootstrap
assert bootstrap.register_stack_dump()


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def work():  # Python work of many places: recursion to a varying depth
    while True:
        for n in range(12, 20):
            fib(n)


def spin():  # a spin inside one call, as a GPU synchronisation spins
    while True: pass


def poll():  # a loop that polls for a file that never comes
    while not os.path.exists("/nonexistent/flag"):
        time.sleep(0.01)


def child():  # its main thread waits for a child process that works (a DataLoader's worker)
    import subprocess
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    print("ready", flush=True)
    p.wait()


shape = sys.argv[1]
if shape != "child":
    print("ready", flush=True)
if shape == "block":
    time.sleep(600)
else:
    globals()[shape]()
"""


@pytest.mark.integration
def test_the_collector_finds_the_ranks_at_work_and_not_those_that_wait(tmp_path):
    """Five ranks at once: Python work and a working child count; a blocking call, a spin in
    one call and a polling loop do not; each rank's place is read from the second look."""
    script = tmp_path / "shapes.py"
    script.write_text(SHAPES)
    shapes = ["work", "block", "spin", "poll", "child"]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), shape],
            env={**os.environ, env.STACKS_DIR: str(tmp_path), "RANK": str(rank)},
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # the child's child is ended with it
        )
        for rank, shape in enumerate(shapes)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        collector = stacks.StackCollector()
        ranks = {r: (p.pid, tmp_path / f"rank{r}.stacks") for r, p in enumerate(procs)}
        assert collector.request(("g", 1, 0), ranks, str(script))
        wait_for(lambda: not collector.collecting(), 20, "both looks")
        found = collector.results(("g", 1, 0))
        assert found is not None and set(found.where) == set(range(5)), found
        assert found.busy == {0, 4}, found
        assert "in fib" in found.where[0] or "at shapes.py" in found.where[0], found.where
        assert found.where[2] == "at shapes.py:18 in spin", found.where
    finally:
        for p in procs:
            os.killpg(p.pid, 9)
            p.wait()
