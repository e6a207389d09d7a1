"""Pre-flight checks a node runs when it joins a job, before it first trains.

Cheap checks that catch a node that would fail anyway: the run directory takes a write and an
fsync, there is free disk and memory, and the training script is readable. A failed check is
reported to the controller, which evicts the node before it costs a restart. A short compute
benchmark (best of a few timed matrix products) gives a score the controller compares across
nodes: a node far below its peers is excluded before training starts (policy.slow_outliers).
The benchmark's `slowdown` is 1 except under an injected `slow_preflight` fault (transom.faults).
This module must never decide about the node: it only measures and reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from transom.common.records import FailureKind, FailureReport, PreflightResult
from transom.control import links

if TYPE_CHECKING:
    from transom.faults import FaultInjector
    from transom.job_spec import JobSpec
    from transom.store import Store
    from transom.store.etcd_client import Lease

MIN_FREE_DISK_BYTES = 256 << 20
MIN_FREE_MEMORY_BYTES = 256 << 20
BENCH_MATRIX = 256
# Timed runs; the best counts (other processes share the cores). 4 of 20 ms score within 1% of
# 5 of 50 ms here at half the CPU (0.19 s a node, its interpreter's start included, not 0.37 s):
# every node of a job, and each simulated replacement, runs it on the job's cores.
BENCH_REPEATS = 4
BENCH_RUN_S = 0.02
BENCH_TIMEOUT_S = 30.0


def compute_benchmark(slowdown: float = 1.0) -> float:
    """GFLOP/s of float32 matrix products per CPU-second on this node (best of BENCH_REPEATS runs).

    CPU time, not wall time: on a machine whose cores are shared (simulated nodes, noisy
    neighbours) it measures how fast the node computes, not how long it waited for a core. It
    runs in a child process with single-threaded BLAS (threads spinning on a busy machine would
    count as CPU time); 0.0 if the child fails. With `slowdown` N > 1 (an injected fault) each
    unit of work costs N times as much.
    """
    slow = max(1, round(slowdown))
    env = {
        **os.environ,
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                _BENCH_CODE,
                str(BENCH_MATRIX),
                str(BENCH_REPEATS),
                str(BENCH_RUN_S),
                str(slow),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=BENCH_TIMEOUT_S,
        )
        return round(float(out.stdout.strip()), 3)
    except (subprocess.SubprocessError, ValueError, OSError):
        return 0.0


_BENCH_CODE = """
import sys, time
import numpy as np
size, repeats, run_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
slow = int(sys.argv[4])
a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
best = 0.0
for _ in range(repeats):
    n, start = 0, time.process_time()
    while (elapsed := time.process_time() - start) < run_s:
        for _ in range(slow):  # an injected fault: the same work counts once but costs `slow` times
            a @ a
        n += 1
    best = max(best, n * 2 * size ** 3 / elapsed / 1e9)
print(best)
"""


def preflight(run_dir: Path, script: str, slowdown: float = 1.0) -> PreflightResult:
    """This node's checks and measurements (`slowdown`: see compute_benchmark); its `time` is
    set when it is published."""
    result = PreflightResult(passed=False, compute_gflops=compute_benchmark(slowdown))
    problems = result.problems
    start = time.perf_counter()
    try:
        probe = Path(run_dir) / f".preflight-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
        result.disk_write_s = round(time.perf_counter() - start, 4)
    except OSError as e:
        problems.append(f"run directory not writable: {e.strerror or e}")
    try:
        free_disk = psutil.disk_usage(str(run_dir)).free
        result.free_disk_bytes = free_disk
        if free_disk < MIN_FREE_DISK_BYTES:
            problems.append(f"only {free_disk >> 20} MiB of disk free")
    except OSError as e:
        problems.append(f"cannot read disk usage: {e}")
    free_memory = psutil.virtual_memory().available
    result.free_memory_bytes = free_memory
    if free_memory < MIN_FREE_MEMORY_BYTES:
        problems.append(f"only {free_memory >> 20} MiB of memory free")
    if not os.access(script, os.R_OK):
        problems.append(f"script {script} is not readable on this node")
    result.passed = not problems
    return result


def joining_checks(
    store: Store,
    node_id: str,
    lease: Lease | None,
    link_server: links.LinkServer,
    spec: JobSpec,
    run_dir: Path,
    faults: FaultInjector,
) -> PreflightResult:
    """Everything a joining node measures: its own checks and compute score (slowed only by an
    injected `slow_preflight` fault), then its links to live peers; its own link-test port is
    published first, so that peers joining later can test it too (slowed, with a `slow_link`
    fault, before anyone can: a bad link is slow both ways)."""
    slowdown = faults.on_preflight()
    link_server.delay_s = faults.link_delay_s
    links.publish(store, node_id, link_server, lease)
    result = preflight(run_dir, spec.script, slowdown)
    peers = spec.nnodes_max + spec.spares - 1
    return links.with_links(result, links.link_test(store, node_id, peers, faults.link_delay_s))


def failed_checks(result: PreflightResult) -> FailureReport:
    """The failure a node reports when its pre-flight checks (from `preflight`) failed."""
    return FailureReport(FailureKind.PREFLIGHT, "; ".join(result.problems))
