"""The scale benchmark (benchmarks/scale/scale_bench.py) runs end to end at a small size.

Its simulated agents are the real NodeAgent with stand-ins for what touches the machine; when
the agent starts calling something new on a part the stand-ins replace, the benchmark must
still run (or fail at once, saying which call), not wait out its start-up timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import child_env

KEYS = (
    "nodes",
    "startup_s",
    "fault_to_plan_s",
    "fault_to_all_acting_s",
    "etcd_requests_per_s",
    "etcd_cpu_x",
    "controller_cpu_x",
)


@pytest.mark.slow
def test_sixteen_simulated_nodes_start_lose_a_node_and_follow_the_new_plan():
    # subprocess.run kills the benchmark at its timeout; the benchmark stops its own etcd,
    # controllers and simulators on SIGTERM and when it dies (they die with their parent).
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.scale",
            "--nodes",
            "16",
            "--window",
            "2",
            "--timeout",
            "60",
        ]
        + ["--json"],
        env=child_env(os.environ),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}, result["errors"]
    (size,) = result["sizes"]
    assert all(size.get(k) is not None for k in KEYS), size
    assert size["nodes"] == 16
    # The new plan reached every member: the fault was handled, not merely timed.
    assert 0 < size["fault_to_plan_s"] <= size["fault_to_all_acting_s"]
