"""The worker-side monitor API: step timings, metrics, phases and a liveness heartbeat.

    from transom import monitor
    with monitor.step(step) as s:
        loss = forward_backward()                 # compute
        with s.section("sync"): all_reduce()      # communication, kept apart from compute
        s.report(loss=loss.item(), tokens=n)
    with monitor.phase("checkpoint"): save()      # step timing not comparable: no detector fires

Everything goes to the node agent as small datagrams (schema: transom.monitor.datagram) on its
monitor channel, a Unix socket only the job's user can reach (transom.monitor.channel), each
naming this rank and generation. A background thread sends a heartbeat after HEARTBEAT_S in
which nothing else went (any datagram tells the agent the rank lives), so the agent can tell a
rank that is alive but stuck (heartbeat goes on, steps stop) from one that is stopped or dead
(heartbeat stops). It wakes every ROUND_S; its late wakes, and the training thread's run-queue
waits, are the rank's stopped time (transom.monitor.stopped_time), which its datagrams carry.
The same thread sends a fast job's
steps, together as one steps datagram every BATCH_S: encoding and sending right after a step's
compute cost about 0.1 ms (the code gone from the CPU's caches, the agent's listener woken),
1-2% of a 20 ms step, and each datagram wakes the agent's listener (issue 44: at a datagram
every 0.1 s its wakes were half of the agent's CPU). Steps
further apart than SLOW_STEP_S, a non-finite metric and the first step after a phase go at once;
waiting steps go before any other datagram and at a normal exit. Each step keeps its own time, so
the agent's timings are the same. A phase is told to the agent by that thread too, once it
lasted PHASE_TOLD_AFTER_S (a checkpoint's memory copy of a few ms costs no datagram: the step it
fell in names it), and its end at once, if its start was told. The calls must never block and
never raise into training:
without an agent (TRANSOM_MONITOR_SOCKET unset) they do nothing, and a lost datagram only means
one sample fewer.

The agent may also hand this rank in-process faults to inject (TRANSOM_FAULTS): this module
calls their hooks (transom.faults.worker) when a step begins and in `StepTimer.inject(loss)`,
and stretches the compute of a rank made slow; what each fault does is defined there.
"""

from __future__ import annotations

import atexit
import math
import os
import socket
import threading
import time
from contextlib import contextmanager

from transom.common import env
from transom.faults.worker import WorkerFaults, parse_worker_faults
from transom.monitor import datagram, stopped_time

HEARTBEAT_S = 0.5
# The sender thread's round: its late wakes (and the training thread's run-queue waits over it)
# are the rank's stopped time.
ROUND_S = stopped_time.SENDER_PERIOD_S
# Steps waiting go as one steps datagram once the oldest waited BATCH_S (to within half a round),
# or when BATCH_STEPS wait: every other round. The agent's straggler windows are seconds long and
# its summaries at least 0.5 s apart (transom.monitor.node). Measured (issue 44): at 0.1 s the
# control plane took 0.0102 cores a node, at 0.2 s 0.0088; at 0.25 s (0.0079) the DDP script's
# quota slowdown was found in 16-17 of 18-19 trials, against 19-20 of 20 at 0.1 and 0.2 s.
BATCH_S = 0.2
BATCH_STEPS = 32
# A step this long after the one before goes at once: a job of slower steps sends a datagram a
# round at most, and an agent-side fault (transom.faults) fires as close to its step as before.
SLOW_STEP_S = ROUND_S
# A phase is told to the agent (a "phase" datagram) once it lasted this long: the sender thread
# wakes every ROUND_S. Told that late, a phase still comes long before a hang could be found
# without it (the hang floor is 1 s at least; in a phase, detectors.PHASE_HANG_S).
PHASE_TOLD_AFTER_S = ROUND_S
RECONNECT_S = 1.0  # how often a rank with no agent socket tries to connect again
SYNC_SECTION = "sync"


class _Channel:
    """The datagram socket to the agent, the heartbeat thread, and this rank's current phase."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.connected = False
        self.connect_tried_at = -math.inf
        self._connect(time.monotonic())
        self.rank = int(os.environ.get("RANK", -1))
        self.generation = int(os.environ.get(env.GENERATION, 0))
        self.phase: str | None = None
        self.phase_since = -math.inf  # time.monotonic() the current phase began (or ended)
        self.phase_told: str | None = None  # the phase the agent last heard of
        self.phases_seen: set[str] = set()  # phases entered since the current step began
        self.last_step: int | None = None
        # Set by the explicit API's first step (`step`, `report`): the zero-code optimizer hook
        # (transom.monitor.auto) then reports nothing, so no step is counted twice.
        self.explicit_steps = False
        self.pending: list[tuple[float, dict]] = []  # step datagrams not sent yet: (time, values)
        self._pending_lock = threading.Lock()  # held only to queue or take `pending`
        # Held while datagrams are encoded and sent, so they leave in order from either thread;
        # a step queued meanwhile waits only for `_pending_lock`, never for a send.
        self._send_lock = threading.RLock()
        # The first step after a phase the agent was told of (a long evaluation) goes at once:
        # until it arrives the agent only knows the step before the phase, long ago.
        self.send_next_step = False
        self.queued_at = -math.inf  # time.time() the last step was queued
        self.sent_at = -math.inf  # time.monotonic() a datagram last left: it beats for this rank
        # The sender thread's late wakes and the training thread's run-queue waits: the main
        # thread, whose id is the pid (also in a warm worker, where threading's main_thread()
        # keeps the id of the interpreter that forked it).
        self.stops = stopped_time.StopMeter(os.getpid())
        atexit.register(self.flush)  # a worker that ends normally sends its last steps
        self.faults = WorkerFaults(
            parse_worker_faults(os.environ.get(env.FAULTS), self.rank), self._announce_fault
        )
        self._closed = threading.Event()
        threading.Thread(target=self._run, name="transom-monitor-sender", daemon=True).start()

    def close(self) -> None:
        """Stop the sender thread (a worker's channel lives as long as its process; tests end
        theirs)."""
        self._closed.set()
        self.sock.close()

    def _connect(self, now: float) -> None:
        """Connect to the agent's socket: a connected send skips sendto(path)'s file-system lookup
        (about 4x the cost of the send). No agent listening yet, or its socket made anew (a new
        monitor), is no error: tried again at most every RECONNECT_S, samples dropped meanwhile.
        """
        self.connect_tried_at = now
        try:
            self.sock.connect(self.path)
            self.connected = True
        except OSError:
            self.connected = False

    def send(self, kind: str, /, **values) -> None:
        """Send a datagram now, after the step datagrams waiting (the agent sees them in order)."""
        with self._send_lock:
            if self.pending:
                self.flush()
            self._send(kind, time.time(), values)

    def send_step(self, values: dict) -> None:
        """Queue a step for the sender thread, which sends those waiting every BATCH_S. Send at
        once a step that came SLOW_STEP_S or more after the one before (a slow job: the send costs
        it little, it arrives without delay, and such steps send a datagram a round at most),
        BATCH_STEPS waiting, the first step after a phase the agent was told of, and a metric
        that is not finite (a NaN is found at its step)."""
        now = time.time()
        with self._pending_lock:
            slow, self.queued_at = now - self.queued_at >= SLOW_STEP_S, now
            self.pending.append((now, values))
            full = len(self.pending) >= BATCH_STEPS
        finite = all(math.isfinite(v) for v in values.values() if isinstance(v, float))
        if slow or full or self.send_next_step or not finite:
            self.flush()

    def flush(self) -> None:
        """Send the steps waiting, in order, as one steps datagram."""
        with self._send_lock:
            with self._pending_lock:
                pending, self.pending = self.pending, []
                self.send_next_step = False
            if pending:
                self._send_batch(pending)

    def _send_batch(self, records: list[tuple[float, dict]]) -> None:
        """One steps datagram, or halves of the batch where it is too long for one."""
        stopped = round(self.stops.total_s, 4)
        data = self._encode(
            lambda: datagram.encode_steps(self.rank, self.generation, records, stopped)
        )
        if data is not None and len(data) > datagram.MAX_BYTES and len(records) > 1:
            half = len(records) // 2
            self._send_batch(records[:half])
            self._send_batch(records[half:])
        elif data is not None:
            self._send_data(data)

    def _send(self, kind: str, t: float, values: dict) -> None:
        data = self._encode(lambda: datagram.encode(kind, self.rank, self.generation, t, **values))
        if data is not None:
            self._send_data(data)

    @staticmethod
    def _encode(encode) -> bytes | None:
        try:
            return encode()
        except Exception:  # noqa: BLE001 - a value that is not JSON
            return None  # one sample fewer; the sender thread must live on

    def _send_data(self, data: bytes) -> None:
        if not self.connected:
            now = time.monotonic()
            if now - self.connect_tried_at < RECONNECT_S:
                return
            self._connect(now)
        try:
            self.sock.send(data)
            self.sent_at = time.monotonic()
        except BlockingIOError:
            pass  # the agent's queue is full: one sample fewer
        except OSError:
            self.connected = False  # the agent's socket is gone: reconnect later

    def _run(self) -> None:
        """The sender thread, every ROUND_S: the steps waiting once the oldest waited BATCH_S, a
        heartbeat HEARTBEAT_S after the last datagram.
        Encoding and sending here, not after the training thread's compute, spares training the
        cost (it runs while a torch operation has let go of the GIL)."""
        while not self._closed.is_set():
            now = time.monotonic()
            try:
                if self.phase != self.phase_told and now - self.phase_since >= PHASE_TOLD_AFTER_S:
                    self.tell_phase("phase")
                elif now - self.sent_at >= HEARTBEAT_S:  # any datagram is a beat to the agent
                    self.tell_phase("beat")
                elif self.pending and time.time() - self.pending[0][0] >= BATCH_S - ROUND_S / 2:
                    self.flush()  # the oldest waited BATCH_S, to within half a round
            except Exception:  # noqa: BLE001 - without this thread the rank would look hung
                pass
            asked = ROUND_S
            before = time.monotonic()
            if self._closed.wait(asked):
                return
            # In a phase, or one began or ended meanwhile: a save may hold Python's lock. In
            # one all along: not a step's time (stopped_time).
            in_phase = self.phase is not None or self.phase_since >= before
            all_in_phase = self.phase is not None and self.phase_since < before
            self.stops.woke(time.monotonic() - before, asked, in_phase, all_in_phase)

    def tell_phase(self, kind: str) -> None:
        """Send a "beat" or "phase" datagram: this rank's newest step and current phase."""
        with self._send_lock:
            phase = self.phase
            self.send(kind, step=self.last_step, phase=phase, stopped=round(self.stops.total_s, 4))
            self.phase_told = phase

    def phase_ended(self, previous: str | None) -> None:
        """The training thread left a phase for `previous`: tell the agent at once if it heard
        of the phase, and send the next step at once then (it waited long for one)."""
        with self._send_lock:
            self.phase, self.phase_since = previous, time.monotonic()
            if self.phase_told != previous:
                self.tell_phase("phase")
                self.send_next_step = True

    def _announce_fault(self, fault: dict, step: int) -> None:
        self.send("fault", fault=fault, step=step)


_channel: _Channel | None = None
_channel_lock = threading.Lock()


def _get() -> _Channel | None:
    global _channel
    if _channel is None:
        path = os.environ.get(env.MONITOR_SOCKET)
        if not path:
            return None
        with _channel_lock:
            if _channel is None:
                try:
                    _channel = _Channel(path)
                except (OSError, ValueError):  # no socket, or a RANK / generation not a number
                    return None
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
        ch.explicit_steps = True
        ch.last_step = int(step)
        values = {k: _number(v) for k, v in metrics.items() if k != "step"}
        ch.send_step({**values, "step": int(step)})
    except Exception:  # noqa: BLE001 - monitoring must never break training
        pass


@contextmanager
def phase(name: str):
    """Mark a stretch (checkpoint save, evaluation) whose step timing is not comparable."""
    previous = enter_phase(name)
    try:
        yield
    finally:
        leave_phase(previous)


def enter_phase(name: str) -> str | None:
    """Begin phase `name` (as `phase` does, for a stretch that does not end in the same
    function); returns the phase it interrupts, for `leave_phase`."""
    ch = _get()
    if ch is None:
        return None
    previous = ch.phase
    name = str(name)[: datagram.MAX_NAME]
    ch.phase, ch.phase_since = name, time.monotonic()
    ch.phases_seen.add(name)
    return previous


def leave_phase(previous: str | None, name: str | None = None) -> None:
    """End the current phase, back to `previous` (what `enter_phase` returned); given its
    `name`, only if the current phase is still that one (not one the script entered since and
    left)."""
    ch = _get()
    if ch is not None and (name is None or ch.phase == name):
        ch.phase_ended(previous)


class StepTimer:
    """One training step: wall time, time in named sections (communication), metrics."""

    def __init__(self, step: int) -> None:
        self.step = int(step)
        self.sections: dict[str, float] = {}
        self.metrics: dict[str, float | None] = {}
        self.start = 0.0
        self.slow_factor = 1.0  # an injected slow node's (its fault fires as the step begins)

    def __enter__(self) -> StepTimer:
        ch = _get()
        if ch is not None:
            ch.explicit_steps = True
            ch.phases_seen.clear()
            ch.faults.on_step(self.step)
            self.slow_factor = ch.faults.state.slow_factor
        self.start = time.perf_counter()
        return self

    def _slow_down(self) -> None:
        """An injected slow node: stretch the compute done so far by the scheduled factor."""
        if self.slow_factor > 1.0 and not self.sections:
            time.sleep((self.slow_factor - 1.0) * (time.perf_counter() - self.start))

    def section(self, name: str = SYNC_SECTION) -> _Section:
        """`with s.section():` time spent there is kept apart from compute (e.g. waiting on an
        all-reduce)."""
        return _Section(self, name)

    def report(self, **metrics: float) -> None:
        """Metrics of this step (loss=..., tokens=...), sent when the step ends."""
        self.metrics.update({k: _number(v) for k, v in metrics.items()})

    def inject(self, loss):
        """Fault hook: returns `loss`, multiplied by NaN when a NaN fault is due at this step."""
        ch = _channel
        return ch.faults.on_loss(self.step, loss) if ch is not None else loss

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
                "dur": duration,
                "comm": comm,
                "compute": max(0.0, duration - comm),
                "phase": sorted(ch.phases_seen)[: datagram.MAX_PHASES] if ch.phases_seen else None,
            }
            message.update({k: v for k, v in self.metrics.items() if k != "step"})
            message["step"] = self.step
            ch.send_step(message)
        except Exception:  # noqa: BLE001 - monitoring must never break training
            pass


class _Section:
    """A timed section of a step (a class, not a generator: it runs after the step's compute,
    when the CPU's caches hold none of this code, and a generator's machinery cost 40 us)."""

    __slots__ = ("name", "start", "timer")

    def __init__(self, timer: StepTimer, name: str) -> None:
        self.timer, self.name, self.start = timer, name, 0.0

    def __enter__(self) -> _Section:
        self.timer._slow_down()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc_info) -> None:
        sections = self.timer.sections
        sections[self.name] = sections.get(self.name, 0.0) + time.perf_counter() - self.start


def step(step: int) -> StepTimer:
    """`with monitor.step(n) as s:` times step n; see StepTimer."""
    return StepTimer(step)
