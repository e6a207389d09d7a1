"""The worker-side monitor API: step timings, metrics, phases and a liveness heartbeat.

    from transom import monitor
    with monitor.step(step) as s:
        loss = forward_backward()                 # compute
        with s.section("sync"): all_reduce()      # communication, kept apart from compute
        s.report(loss=loss.item(), tokens=n)
    with monitor.phase("checkpoint"): save()      # step timing not comparable: detectors stay silent

Everything goes to the node agent as small UDP datagrams on loopback. A background thread sends
a heartbeat every HEARTBEAT_S, so the agent can tell a rank that is alive but stuck (heartbeat
goes on, steps stop) from one that is stopped or dead (heartbeat stops). The calls must never
block and never raise into training: without an agent (TRANSOM_MONITOR_PORT unset) they do
nothing, and a lost datagram only means one sample fewer.

The agent may also hand this rank in-process faults to inject (TRANSOM_FAULTS, see
transom.monitor.faults): a slow compute section or a NaN loss. This module applies them; it
must never inject anything that was not scheduled. A fault with a "once_file" path fires only
if this process can create that file (O_EXCL), so it fires once even when a launcher other than
Transom restarts the worker with the same environment.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from contextlib import contextmanager

MONITOR_PORT_ENV = "TRANSOM_MONITOR_PORT"
FAULTS_ENV = "TRANSOM_FAULTS"
HEARTBEAT_S = 0.5
SYNC_SECTION = "sync"


class _Channel:
    """The datagram socket to the agent, the heartbeat thread, and this rank's current phase."""

    def __init__(self, port: int) -> None:
        self.addr = ("127.0.0.1", port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.rank = int(os.environ.get("RANK", -1))
        self.phase: str | None = None
        self.phases_seen: set[str] = set()  # phases entered since the current step began
        self.last_step: int | None = None
        try:
            self.faults = [
                f
                for f in json.loads(os.environ.get(FAULTS_ENV, "[]"))
                if f.get("rank") in (None, self.rank)
            ]
        except ValueError:
            self.faults = []
        self.slow_factor = 1.0
        threading.Thread(target=self._beat, name="transom-monitor-heartbeat", daemon=True).start()

    def send(self, message: dict) -> None:
        message["rank"] = self.rank
        message["t"] = time.time()
        try:
            self.sock.sendto(json.dumps(message).encode(), self.addr)
        except OSError:
            pass  # the agent is gone or the buffer is full: one sample fewer

    def _beat(self) -> None:
        while True:
            self.send({"k": "beat", "step": self.last_step, "phase": self.phase})
            time.sleep(HEARTBEAT_S)

    # -- in-process faults --------------------------------------------------------------------
    def due_faults(self, step: int, kind: str) -> list[dict]:
        due = [f for f in self.faults if f["type"] == kind and step >= f["step"]]
        for f in due:
            self.faults.remove(f)
        due = [f for f in due if _claim(f.get("once_file"))]
        for f in due:
            self.send({"k": "fault", "fault": f, "step": step})
        return due


def _claim(once_file: str | None) -> bool:
    """True if a fault may fire: it has no once_file, or this call created it."""
    if once_file is None:
        return True
    try:
        os.close(os.open(once_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except OSError:
        return False  # fired before (or the folder is gone): never fire twice


_channel: _Channel | None = None
_channel_lock = threading.Lock()


def _get() -> _Channel | None:
    global _channel
    if _channel is None:
        port = os.environ.get(MONITOR_PORT_ENV)
        if not port:
            return None
        with _channel_lock:
            if _channel is None:
                _channel = _Channel(int(port))
    return _channel


def _number(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def report(step: int, **metrics: float) -> None:
    """Tell the node agent that this rank finished `step`, with optional scalar metrics."""
    try:
        ch = _get()
        if ch is None:
            return
        ch.last_step = int(step)
        message = {"k": "step", "step": int(step)}
        message.update({k: _number(v) for k, v in metrics.items()})
        ch.send(message)
    except Exception:  # noqa: BLE001 - monitoring must never break training
        pass


@contextmanager
def phase(name: str):
    """Mark a stretch (checkpoint save, evaluation) whose step timing is not comparable."""
    ch = _get()
    previous = ch.phase if ch else None
    if ch:
        ch.phase = name
        ch.phases_seen.add(name)
        ch.send({"k": "phase", "phase": name, "step": ch.last_step})
    try:
        yield
    finally:
        if ch:
            ch.phase = previous
            ch.send({"k": "phase", "phase": previous, "step": ch.last_step})


class StepTimer:
    """One training step: wall time, time in named sections (communication), metrics."""

    def __init__(self, step: int) -> None:
        self.step = int(step)
        self.sections: dict[str, float] = {}
        self.metrics: dict[str, float | None] = {}
        self.start = 0.0

    def __enter__(self) -> StepTimer:
        ch = _get()
        if ch is not None:
            ch.phases_seen.clear()
            for f in ch.due_faults(self.step, "slow"):
                ch.slow_factor = max(ch.slow_factor, float(f.get("factor", 2.0)))
        self.start = time.perf_counter()
        return self

    def _slow_down(self) -> None:
        """An injected slow node: stretch the compute done so far by the scheduled factor."""
        ch = _channel
        if ch is not None and ch.slow_factor > 1.0 and not self.sections:
            time.sleep((ch.slow_factor - 1.0) * (time.perf_counter() - self.start))

    @contextmanager
    def section(self, name: str = SYNC_SECTION):
        """Time spent here is kept apart from compute (e.g. waiting on an all-reduce)."""
        self._slow_down()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sections[name] = self.sections.get(name, 0.0) + time.perf_counter() - t0

    def report(self, **metrics: float) -> None:
        """Metrics of this step (loss=..., tokens=...), sent when the step ends."""
        self.metrics.update({k: _number(v) for k, v in metrics.items()})

    def inject(self, loss):
        """Fault hook: returns `loss`, multiplied by NaN when a NaN fault is due at this step."""
        ch = _channel
        if ch is not None and ch.faults and ch.due_faults(self.step, "nan"):
            return loss * math.nan
        return loss

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if not self.sections:
                self._slow_down()
            duration = time.perf_counter() - self.start
            ch = _channel
            if ch is None or exc_type is not None:
                return
            ch.last_step = self.step
            comm = sum(self.sections.values())
            message = {
                "k": "step",
                "step": self.step,
                "dur": duration,
                "comm": comm,
                "compute": duration - comm,
                "phase": sorted(ch.phases_seen) or None,
            }
            message.update(self.metrics)
            ch.send(message)
        except Exception:  # noqa: BLE001 - monitoring must never break training
            pass


def step(step: int) -> StepTimer:
    """`with monitor.step(n) as s:` times step n; see StepTimer."""
    return StepTimer(step)
