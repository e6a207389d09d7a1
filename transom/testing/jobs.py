"""What the benchmarks and the tests that run jobs share (tests/conftest.py re-exports it):
the `transom run` command line, its progress lines, waiting with a deadline, finding and
stopping a job's processes, reaching a job's embedded etcd and counting the requests it received.

train_gpt.py (transom/workloads/train_gpt.py) prints, each with t=time.time() (see its docstring):
    [train_gpt] start rank=R world=W t=...     [train_gpt] resumed step=S rank=R t=...
    step N loss X t=... (rank 0)               [train_gpt] done step=N rank=R t=...
under torchrun possibly prefixed with "[rankR]: ". This module only reads, waits and stops; it
never starts a job.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import psutil

from transom.common import files
from transom.control import warm
from transom.store import StoreAccess
from transom.store.tls import CA_FILE, CLIENT_CERT_FILE, CLIENT_KEY_FILE

STOP_GRACE_S = 20
# The smallest example GPT (examples/train_gpt.py options) the tests and the torture suite train.
SMALL_GPT = "--n-layer 1 --n-head 2 --n-embd 32 --block-size 32 --batch-size 8".split()
LINE = re.compile(
    r"^(?:\[\w+\]: )?(?:\[train_gpt\] (?P<what>start|resumed|done)\b(?P<fields>.*?)"
    r"|step (?P<step>\d+) .*?)t=(?P<t>\d+\.\d+)",
    re.M,
)
FIELD = re.compile(r"(\w+)=(\d+)")
ETCD_MESSAGES = re.compile(r"^grpc_server_msg_received_total\{([^}]*)\} (\S+)$", re.M)
ETCD_METHOD = re.compile(r'grpc_method="([^"]*)"')


def embedded_etcd(run_dir: Path) -> psutil.Process | None:
    """The embedded etcd of the job in `run_dir` (its data under it), None while none runs."""
    data_dir = str(run_dir / files.ETCD)
    for p in psutil.process_iter(["cmdline"]):
        words = p.info["cmdline"] or []
        if any(a == "--data-dir" and b == data_dir for a, b in itertools.pairwise(words)):
            return p
    return None


def etcd_access(etcd: psutil.Process, run_dir: Path) -> StoreAccess:
    """How to reach `etcd`, the embedded etcd of the job in `run_dir`: the client address on its
    command line, the run's client certificate."""
    words = etcd.cmdline()
    url = words[words.index("--listen-client-urls") + 1]
    tls = run_dir / files.ETCD_TLS
    return StoreAccess(url, tls / CA_FILE, tls / CLIENT_CERT_FILE, tls / CLIENT_KEY_FILE)


def etcd_requests_by_method(store) -> dict[str, float]:
    """etcd's count of gRPC messages received so far (every gateway request is at least one),
    by method (Put, Range, LeaseKeepAlive, ...), from its metrics; `store` a transom Store."""
    text = store.client.session.get(f"{store.access.url}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for labels, value in ETCD_MESSAGES.findall(text):
        method = ETCD_METHOD.search(labels)
        name = method.group(1) if method else "?"
        counts[name] = counts.get(name, 0.0) + float(value)
    return counts


class Line(NamedTuple):
    what: str  # start | resumed | done | step
    step: int | None  # the step of a step line, the resumed/done step of the others
    rank: int | None  # None on step lines (rank 0 prints them)
    t: float


def transom_run(run_dir: Path, job_id: str, *options: str, log_level: str = "warning") -> list[str]:
    """The command line that starts job `job_id` under `transom run`, with `options` after (at
    `log_level` debug, its controllers log every straggler evaluation)."""
    return [
        sys.executable, "-m", "transom", "--log-level", log_level, "run", "--run-dir",
        str(run_dir), "--job-id", job_id, *options,
    ]  # fmt: skip


def parse(text: str) -> list[Line]:
    """Every progress line in `text`, in the order printed."""
    lines = []
    for m in LINE.finditer(text):
        fields = {k: int(v) for k, v in FIELD.findall(m.group("fields") or "")}
        step = int(m.group("step")) if m.group("step") else fields.get("step")
        lines.append(Line(m.group("what") or "step", step, fields.get("rank"), float(m.group("t"))))
    return lines


def finish(process: subprocess.Popen, marker: str, timeout: float) -> bool:
    """Wait for the job; stop it and every process naming `marker` after `timeout`.

    True if it succeeded."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if (
            process.poll() is None
        ):  # Ctrl-C first, so the launcher frees what it holds (shared memory)
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        kill_marked(marker)
    return process.returncode == 0


def wait_for(predicate, timeout: float, what: str | Callable[[], str], interval: float = 0.1):
    """Poll `predicate` until it returns something truthy and return that; TimeoutError naming
    `what` after `timeout` seconds (a test fails on it, a benchmark may catch it). `what` may be
    a function, called at the timeout: its text can say what was seen instead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(
        f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}"
    )


def job_processes(marker: str) -> list[psutil.Process]:
    """Live processes (not zombies, not this one) whose command line or TRANSOM_JOB_ID names
    `marker` (a job id or a run directory)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if marker in " ".join(p.info["cmdline"] or []) or (
                p.environ().get("TRANSOM_JOB_ID") == marker
            ):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def node_processes(marker: str, node: str) -> list[psutil.Process]:
    """Every process of `node` in the job `marker` names, the agent last: its children, and
    its warm interpreter and workers, which are the machine's warm template's children where
    the launcher runs several nodes (transom.control.warm_template)."""
    agent = agent_process(marker, node)
    if agent is None:
        return []
    title = f"{warm.TITLE} (job "
    found = []
    for p in job_processes(marker):
        with contextlib.suppress(psutil.Error):
            words = " ".join(p.cmdline())
            if words.startswith(title) and words.endswith(f", node {node})"):
                found += [*p.children(recursive=True), p]
    with contextlib.suppress(psutil.Error):
        found += agent.children(recursive=True)
    return [*{p.pid: p for p in found}.values(), agent]


def agent_process(marker: str, node: str) -> psutil.Process | None:
    """The node agent of `node` in the job `marker` names (`job_processes`); never its checkpoint
    server, whose command line names the node too (which of the two comes first in the process
    table is the order of their pids, and pids wrap)."""
    for p in job_processes(marker):
        try:
            words = p.cmdline()
        except psutil.Error:
            continue
        command = words[words.index("-m") + 1 :] if "-m" in words else []
        node_at = command.index("--node-id") + 1 if "--node-id" in command else 0
        if command[:1] == ["transom"] and "agent" in command and command[node_at:][:1] == [node]:
            return p
    return None


def kill_marked(marker: str) -> None:
    """SIGKILL every process that names `marker` (torchrun starts workers in sessions of their
    own, so killing a process group does not reach them)."""
    for p in job_processes(marker):
        try:
            p.kill()
        except psutil.Error:
            continue
