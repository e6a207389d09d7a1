"""The goodput benchmark's baseline: four torchrun agents and an injector playing the schedule.

Used by goodput.py (see its docstring). Faults are injected of the same type at the same step as
under Transom: this module listens to the workers' monitor datagrams for their steps.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil

from benchmarks.goodput.common import (  # noqa: E402
    MAX_RESTARTS,
    NODES,
    POLL_S,
    RUN_TIMEOUT_S,
    free_port,
    measure,
    say,
    script_args,
    show_progress,
    worker_env,
)
from transom.common import env as env_names  # noqa: E402
from transom.faults import WORKER_FAULTS  # noqa: E402
from transom.monitor import datagram  # noqa: E402
from transom.monitor.channel import ChannelSocket  # noqa: E402
from transom.testing.jobs import Line, kill_marked, parse

# -- torchrun --------------------------------------------------------------------------------


class TorchrunJob:
    """Four torchrun agents (simulated nodes) and the injector playing the schedule on them."""

    def __init__(self, args, work: Path, schedule: list[dict]):
        self.args = args
        self.work = work
        self.schedule = schedule
        self.run_id = "goodput-" + uuid.uuid4().hex[:6]
        self.ckpt = work / f"{self.run_id}-ckpt"
        self.final = work / f"{self.run_id}-final.pt"
        self.rdzv_port = free_port()
        self.channel = ChannelSocket(self.run_id)  # the workers' monitor datagrams
        self.lock = threading.Lock()
        self.agents: dict[str, subprocess.Popen] = {}  # node -> its current torchrun agent
        self.killed: list[subprocess.Popen] = []
        self.outputs: list[Path] = []
        self.steps: dict[int, int] = {}  # rank -> its newest reported step
        self.fired: list[dict] = []
        self.stopping = threading.Event()

    def command(self, node: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(NODES),
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{self.rdzv_port}",
            "--rdzv-id",
            self.run_id,
            "--rdzv-conf",
            f"is_host={int(node == 'node0')}",
            "--max-restarts",
            str(MAX_RESTARTS),
            *script_args(self.args, self.final),
            "--checkpoint",
            "torch",
            "--ckpt-dir",
            str(self.ckpt),
            "--fail-on-nan",
            "--collective-timeout",
            str(self.args.collective_timeout),
        ]

    def env(self, node: str) -> dict[str, str]:
        """The agent's environment: the monitor port, the worker-side faults aimed at its worker."""
        faults = []
        for f in self.schedule:
            if f["type"] in WORKER_FAULTS and f["node"] in (None, node):
                faults.append(
                    f
                    | {"once_file": str(self.work / f"{self.run_id}-{f['id']}.fired")}
                    | ({"rank": None} if f["node"] else {})
                )
        return worker_env() | {
            env_names.MONITOR_SOCKET: str(self.channel.path),
            env_names.FAULTS: json.dumps(faults),
        }

    def start_agent(self, node: str) -> None:
        out_path = self.work / f"{self.run_id}-{node}-{len(self.outputs)}.out"
        self.outputs.append(out_path)
        with open(out_path, "wb") as out:
            self.agents[node] = subprocess.Popen(
                self.command(node),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(node),
                start_new_session=True,
            )

    def lines(self) -> list[Line]:
        return [x for p in self.outputs if p.exists() for x in parse(p.read_text(errors="replace"))]

    # -- the injector ---------------------------------------------------------------------------
    def workers(self) -> dict[int, tuple[str, psutil.Process]]:
        """rank -> (node, worker process) of the running workers."""
        out = {}
        for node, agent in list(self.agents.items()):
            try:
                for child in psutil.Process(agent.pid).children(recursive=True):
                    rank = child.environ().get("RANK")
                    if rank is not None:
                        out[int(rank)] = (node, child)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return out

    def listen(self) -> None:
        pending = [f for f in self.schedule if f["type"] not in WORKER_FAULTS]
        while not self.stopping.is_set():
            received = self.channel.receive()
            message = datagram.parse(received.data) if received is not None else None
            if not isinstance(message, datagram.Message):
                continue
            rank, step = message.rank, message.values.get("step")
            if message.kind == "fault":  # the reporter fired a worker-side fault
                self.record(message.values["fault"], message.t or time.time(), step, rank)
            elif message.kind == "steps":  # the reporter sends its steps in batches
                self.steps[rank] = message.values["steps"][-1].values["step"]
                step = self.steps[rank]
                for f in [f for f in pending if step >= f["step"]]:
                    if self.inject(f):
                        pending.remove(f)

    def record(
        self, f: dict, when: float, step: int | None, rank: int | None, node: str | None = None
    ) -> None:
        node = node or f.get("node")
        target = f"{node} rank {rank}" if node else f"rank {rank}"
        self.fired.append(
            {"id": f["id"], "fault": f["type"], "step": step, "time": when, "target": target}
        )
        say(f"  torchrun: injected {f['type']} on {target} at step {step}")

    def inject(self, f: dict) -> bool:
        """Fire an agent-side fault if its target has reached its step; True once fired."""
        for rank, (node, worker) in self.workers().items():
            if (f["node"] or None) not in (None, node) or (f["node"] is None and f["rank"] != rank):
                continue
            if self.steps.get(rank, 0) < f["step"]:
                return False
            when = time.time()
            try:
                if f["type"] == "crash":
                    worker.send_signal(signal.SIGKILL)
                elif f["type"] == "hang":
                    worker.send_signal(signal.SIGSTOP)
                elif f["type"] == "kill":
                    with self.lock:
                        agent = self.agents.pop(node)
                        agent.kill()
                        worker.kill()
                        self.killed.append(agent)
                        self.start_agent(node)  # the hot spare takes its place at once
            except psutil.NoSuchProcess:
                return False
            self.record(f, when, self.steps.get(rank), rank, node)
            return True
        return False

    def run(self) -> dict:
        say(
            f"torchrun: {self.args.steps} steps with the same faults, collective timeout "
            f"{self.args.collective_timeout:g} s ..."
        )
        listener = threading.Thread(target=self.listen, name="fault-injector", daemon=True)
        launched = time.time()
        with self.lock:
            for i in range(NODES):
                self.start_agent(f"node{i}")
        listener.start()
        last = [time.time()]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                with self.lock:
                    running = [a for a in self.agents.values() if a.poll() is None]
                if not running:
                    break
                show_progress("torchrun", self.lines(), launched, self.args.steps, last)
                time.sleep(POLL_S)
        finally:
            self.stopping.set()
            listener.join()
            with self.lock:
                codes = [a.returncode for a in self.agents.values()]
                for agent in [*self.agents.values(), *self.killed]:
                    if agent.poll() is None:
                        agent.kill()
                        agent.wait()
            kill_marked(
                str(self.ckpt)
            )  # workers (a stopped one included) live in sessions of their own
            self.channel.close()
        if any(code != 0 for code in codes):
            raise RuntimeError(
                f"the torchrun job failed (agents exited {codes}); see {self.outputs}"
            )
        return measure(self.lines(), launched, self.args.steps, self.fired)
