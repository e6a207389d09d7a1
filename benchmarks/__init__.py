"""Transom's benchmarks, run from the repository root as modules:

    python -m benchmarks.checkpoint        checkpoint save/load against torch.save/load and DCP
    python -m benchmarks.checkpoint_gpu    the same engine's CUDA path (needs a GPU)
    python -m benchmarks.detection         detection latency, attribution, false positives
    python -m benchmarks.etcd_requests     etcd's requests a node a second in a steady job
    python -m benchmarks.etcd_size         the embedded etcd's size under rewrites
    python -m benchmarks.fingerprint_cost  what replica fingerprints cost the demo model's step
    python -m benchmarks.goodput           one job through five faults, Transom against torchrun
    python -m benchmarks.job_overhead      a fault-free job's overhead against torchrun
    python -m benchmarks.monitor.blocks    the monitor's overhead inside one process
    python -m benchmarks.monitor.overhead  the monitor's overhead, process against process
    python -m benchmarks.projection        the measured costs projected to a cluster (no processes)
    python -m benchmarks.recovery          fault to first step, against torchrun
    python -m benchmarks.scale             the real controller and up to 1,024 simulated agents
    python -m benchmarks.snapshots         what a checkpoint every step costs the demo's model
    python -m benchmarks.torture           faults of Transom's own control plane

Each prints a readable table; with `--json` the last line of output is one JSON object. The
current numbers and the command behind each are in docs/benchmarks.md; results/ holds the JSON
of the runs it cites. Nothing outside benchmarks/ imports from here but the benchmarks' own
tests; what benchmarks and tests share is in transom/testing/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a child `python -m benchmarks.X`: the repository first on its PYTHONPATH, so the
    child finds this package wherever it was started from."""
    path = [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


def run_module(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`python -m benchmarks.ARGS` as a user runs it (from the repository root, `child_env`), its
    output captured as text (the benchmarks' own tests)."""
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        env=child_env(os.environ),
    )


def last_json(stdout: str) -> Any:
    """The JSON object a benchmark run with `--json` printed last."""
    return json.loads(stdout.strip().splitlines()[-1])
