"""What the goodput benchmark's parts share: its constants, worker environment, and measures.

Used by goodput_bench.py (see its docstring for what is measured) and torchrun.py. This module
never starts a job.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import REPO
from transom.common import env as env_names  # noqa: E402
from transom.testing.jobs import Line

SCRIPT = REPO / "examples" / "train_gpt.py"
NODES = 4
STEPS = 720
CKPT_EVERY = 20
TRANSOM_CKPT_EVERY = 1  # train_gpt.py's own default under transom run: a snapshot every step
COLLECTIVE_TIMEOUT_S = 60
MAX_RESTARTS = 10
DEFAULT_FAULTS = (
    "crash@step=60:rank=1,kill@step=200:node=node3,hang@step=340:rank=2,"
    "nan@step=480:rank=0,slow@step=620:node=node1:factor=3"
)
BASELINE_FAULTS = ("crash", "hang", "kill", "slow", "nan")
TRANSOM_SPARES = [
    "--spares",
    "1",
    "--refill-spares",
]  # a new simulated node replaces each evicted one
RUN_TIMEOUT_S = 900
PROGRESS_EVERY_S = 10
POLL_S = 0.2
TARGET_SOONER = 0.28


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        env_names.MONITOR_SOCKET,
        env_names.FAULTS,
        env_names.CHECKPOINT_DIR,
        "TORCHELASTIC_RUN_ID",
    ):
        env.pop(name, None)
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: without it torchrun restarts reuse stale gloo addresses
    # from the previous attempt and fail or hang (pytorch issue 135712).
    return env | {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_args(args, final: Path, ckpt_every: int | None = None) -> list[str]:
    """train_gpt's arguments: checkpoints every `ckpt_every` steps (default: --ckpt-every)."""
    return [
        str(SCRIPT),
        "--steps",
        str(args.steps),
        "--log-every",
        "1",
        "--ckpt-every",
        str(args.ckpt_every if ckpt_every is None else ckpt_every),
        "--save-final",
        str(final),
    ]


# -- measuring ------------------------------------------------------------------------------------


def rank0_timeline(lines: list[Line]) -> list[Line]:
    """Rank 0's resumed and step lines, in time order (one process after another)."""
    return sorted(
        (x for x in lines if x.what == "step" or (x.what == "resumed" and x.rank == 0)),
        key=lambda x: x.t,
    )


def step_durations(timeline: list[Line]) -> list[tuple[int, float, float]]:
    """(step, end time, duration) of every step rank 0 completed; a process's first step counts
    from its `resumed` line."""
    out, previous = [], None
    for x in timeline:
        if x.what == "step" and previous is not None:
            out.append((x.step, x.t, x.t - previous))
        previous = x.t
    return out


def measure(lines: list[Line], launched: float, steps: int, faults: list[dict]) -> dict:
    """wall_s, ettr_x, lost_steps and per-fault cost_s from rank 0's lines and the injections."""
    timeline = rank0_timeline(lines)
    done = step_durations(timeline)
    final = {}  # the last run of each step is the one in the final model
    for step, end, duration in done:
        final[step] = (end, duration)
    if set(final) != set(range(1, steps + 1)):
        missing = sorted(set(range(1, steps + 1)) - set(final))
        raise RuntimeError(f"rank 0 did not complete every step (missing {missing[:5]} ...)")
    wall = final[steps][0] - launched
    first_fault = min((f["time"] for f in faults), default=float("inf"))
    normal = statistics.median(
        [d for s, end, d in done if end < first_fault and s > 2] or [d for _, _, d in done]
    )
    resumes = [x.t for x in timeline if x.what == "resumed"]
    costs = []
    ordered = sorted(faults, key=lambda f: f["time"])
    for i, f in enumerate(ordered):
        t_f = f["time"]
        before = [s for s, end, _ in done if end <= t_f]
        s_f = max(before, default=0)
        if (
            f["fault"] == "slow"
        ):  # the extra time until the next fault (or the end) over the normal pace
            t_next = ordered[i + 1]["time"] if i + 1 < len(ordered) else final[steps][0]
            reached = max((s for s, end, _ in done if end <= t_next), default=s_f)
            t_back = max(end for s, end, _ in done if s == reached and end <= t_next)
            cost = (t_back - t_f) - (reached - s_f) * normal
        else:  # back at the highest step reached before the restart
            restart = min((t for t in resumes if t > t_f), default=None)
            if restart is None:
                cost, reached = None, s_f
            else:
                reached = max((s for s, end, _ in done if t_f < end < restart), default=s_f)
                # back when a step at or past `reached` is done, or a resume starts past it
                t_back = min(x.t for x in timeline if x.t >= restart and x.step >= reached)
                cost = (t_back - t_f) - (reached - s_f) * normal
        costs.append(
            {
                "id": f["id"],
                "fault": f["fault"],
                "step": f["step"],
                "target": f["target"],
                "at_step": s_f,
                "cost_s": cost,
            }
        )
    useful = sum(duration for _, duration in final.values())
    startup = min(end for s, end, _ in done if s == 1) - launched
    return {
        "wall_s": wall,
        "ettr_x": useful / wall,
        "lost_steps": len(done) - steps,
        "normal_step_s": normal,
        "startup_s": startup,
        "faults": costs,
    }


def compare_weights(path: Path, reference: Path | None) -> dict:
    """{"weights_match": bool, "max_abs_diff": float, "differing": [names]} vs the reference."""
    if reference is None or not reference.exists():
        return {"weights_match": None}
    if not path.exists():
        return {"weights_match": False, "differing": ["(no final weights saved)"]}
    a, b = torch.load(path, weights_only=True), torch.load(reference, weights_only=True)
    differing = sorted(k for k in b if k not in a or not torch.equal(a[k], b[k]))
    diff = max(
        (float((a[k].float() - b[k].float()).abs().max()) for k in differing if k in a), default=0.0
    )
    return {"weights_match": not differing, "max_abs_diff": diff, "differing": differing[:5]}


def show_progress(
    system: str, lines: list[Line], launched: float, steps: int, last: list[float]
) -> None:
    if time.time() - last[0] < PROGRESS_EVERY_S:
        return
    last[0] = time.time()
    reached = max((x.step for x in lines if x.what == "step"), default=0)
    say(f"  {system}: step {reached}/{steps} after {time.time() - launched:.0f} s")
