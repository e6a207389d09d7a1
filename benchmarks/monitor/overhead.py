"""The monitor's end-to-end cost: a one-process train_gpt with the monitor on and off, in pairs.

Each pair runs examples/train_gpt.py twice with the same seed and steps, once reporting to a live
node monitor (transom.monitor.node.NodeMonitor, listening in this process as the agent would in
its own) and once without (TRANSOM_MONITOR_SOCKET unset: every monitor call returns at once); the
order alternates (on-off, off-on, ...) so a drift of the machine's load hits both sides alike. A
run's step time is its mean step time from the times of its log's step lines (the first
SKIP_STEPS left out). The overhead of a pair is on/off - 1; the result is their mean with a 95%
bootstrap confidence interval (stats.py), and the monitor calls' own cost a
step measured in a tight loop (`api_call_s`, to a listener in another process).

With --auto the pairs measure the zero-code instrumentation instead (transom.monitor.auto):
benchmarks/monitor/plain_loop.py, a loop without any transom call, started through the worker
bootstrap (`python -m transom.control.bootstrap`: its optimizer hook, heartbeat and collective
timing report to the monitor) against the same loop started plainly (`python SCRIPT`).

On a machine shared with other work the pairs are noisy: read the interval, not the mean.

    python -m benchmarks.monitor.overhead --pairs 20 --steps 300
    python -m benchmarks.monitor.overhead --auto --pairs 20 --steps 300
    python -m benchmarks.monitor.overhead --json      # last line: JSON
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import REPO, stats

SCRIPT = REPO / "examples" / "train_gpt.py"
PLAIN = REPO / "benchmarks" / "monitor" / "plain_loop.py"
from transom.common import env as env_names  # noqa: E402

STEP_LINE = re.compile(r"^step (\d+) loss \S+ t=(\d+\.\d+)$", re.M)
SKIP_STEPS = 5
TARGET = 0.01


def step_time(out: str) -> float:
    """Mean seconds a step: the log's times have millisecond resolution, a step takes a few ms,
    so a median of single gaps would only say 16 or 17 ms; the mean over the run is exact."""
    points = [float(t) for _, t in STEP_LINE.findall(out)][SKIP_STEPS:]
    return (points[-1] - points[0]) / (len(points) - 1)


def run_once(tmp: Path, steps: int, socket_path: Path | None, auto: bool = False) -> float:
    """One run's mean step time: train_gpt (its monitor calls on with `socket_path`), or with
    `auto` the plain loop (through the worker bootstrap with `socket_path`, else plainly)."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("TRANSOM_", "RANK", "WORLD_SIZE"))
    }
    env["OMP_NUM_THREADS"] = "1"
    if socket_path is not None:
        env[env_names.MONITOR_SOCKET] = str(socket_path)
        env["RANK"] = "0"  # the monitor's datagrams name their rank
    if auto:
        boot = ["-m", "transom.control.bootstrap"] if socket_path is not None else []
        env["PYTHONPATH"] = str(REPO)
        argv = [sys.executable, "-u", *boot, str(PLAIN), "--steps", str(steps)]
    else:
        argv = [sys.executable, str(SCRIPT), "--steps", str(steps)]
        argv += ["--ckpt-every", "0", "--log-every", "1"]
    out = subprocess.run(
        argv,
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp,
        timeout=600,
    ).stdout
    return step_time(out)


def measure(tmp: Path, pairs: int, steps: int, auto: bool = False) -> dict:
    """Alternating on/off pairs of one-process runs: the monitor's overhead with its interval
    (`auto`: the zero-code instrumentation's, on the plain loop)."""
    from transom.monitor.node import NodeMonitor

    monitor = NodeMonitor("overhead")
    monitor.expect_ranks([0])  # the one rank of generation 0: its datagrams are accepted
    on, off = [], []
    try:
        for i in range(pairs):
            for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                path = monitor.socket_path if mode == "on" else None
                (on if mode == "on" else off).append(run_once(tmp, steps, path, auto))
        accepted = monitor.counters()["accepted"]
    finally:
        monitor.close()
    ratios = [a / b - 1.0 for a, b in zip(on, off, strict=True)]
    low, high = stats.interval(ratios)
    call = api_call_s()
    off_s = statistics.median(off)
    return {
        "mode": "auto" if auto else "api",
        "pairs": pairs,
        "steps": steps,
        "step_on_s": statistics.median(on),
        "step_off_s": off_s,
        "overhead_x": statistics.fmean(ratios),
        "overhead_ci95_x": [low, high],
        "overhead_pairs_x": [round(r, 5) for r in ratios],
        "datagrams_accepted": accepted,
        "api_call_s": call,
        "api_overhead_x": call / off_s,
    }


def api_call_s(calls: int = 20000) -> float:
    """Seconds one step's monitor calls (step, sync section, report) cost in a tight loop, sent
    to a socket drained by another process (as the agent's listener is)."""
    from transom.monitor import reporter

    with tempfile.TemporaryDirectory(prefix="transom-overhead-") as tmp:
        path = str(Path(tmp) / "s")
        drain = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import socket, sys\n"
                "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.bind(sys.argv[1])\n"
                "print('ready', flush=True)\n"
                "while True: s.recv(8192)",
                path,
            ],
            stdout=subprocess.PIPE,
        )
        try:
            assert drain.stdout is not None
            drain.stdout.readline()
            saved = {k: os.environ.get(k) for k in (env_names.MONITOR_SOCKET, "RANK")}
            os.environ[env_names.MONITOR_SOCKET], os.environ["RANK"] = path, "0"
            reporter._channel = None  # a channel to this socket
            t0 = time.perf_counter()
            for i in range(calls):
                with reporter.step(i) as s:
                    with s.section("sync"):
                        pass
                    s.report(loss=1.0, tokens=768)
            return (time.perf_counter() - t0) / calls
        finally:
            drain.kill()
            drain.wait()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def describe(o: dict) -> str:
    low, high = o["overhead_ci95_x"]
    return (
        f"{'zero-code ' if o.get('mode') == 'auto' else ''}monitoring overhead: "
        f"{o['overhead_x'] * 100:+.2f}% (95% CI {low * 100:+.2f}% to "
        f"{high * 100:+.2f}%, {o['pairs']} alternating on/off pairs of {o['steps']} steps; step "
        f"{o['step_on_s'] * 1000:.2f} ms on vs {o['step_off_s'] * 1000:.2f} ms off, medians); "
        f"the calls themselves: {o['api_call_s'] * 1e6:.1f} us a step = "
        f"{o['api_overhead_x'] * 100:.3f}%"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=20, help="on/off pairs (default 20)")
    p.add_argument("--steps", type=int, default=300, help="steps a run (default 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument(
        "--auto",
        action="store_true",
        help="measure the zero-code instrumentation on an unmodified loop (plain_loop.py)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="transom-overhead-") as tmp:
        result = measure(Path(tmp), args.pairs, args.steps, args.auto)
    print_result(describe(result), result, args.json)
    return 0


def print_result(text: str, result: dict, as_json: bool) -> None:
    """The result in words, whether its interval shows the target, and (`as_json`) JSON."""
    print(text)
    verdict = "below" if result["overhead_ci95_x"][1] < TARGET else "not shown below"
    print(f"target: {verdict} {TARGET * 100:.0f}% (the interval's upper end)")
    if as_json:
        print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
