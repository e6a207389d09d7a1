"""A fault that slows a worker from outside its process: throttle (as CPU throttling would).

A real slowdown of one rank (a thermal or power limit, a CPU quota, a noisy neighbour) does not
land in a section of the training step the way the worker-side `slow` fault does: it stretches
whatever the rank is doing at the time, compute, communication and its monitor's heartbeat alike.
This fault plays that from the node agent: a thread of the agent stops the worker (SIGSTOP) and
lets it run again (SIGCONT) with a duty cycle, so the worker runs 1/FACTOR of each PERIOD (default
THROTTLE_PERIOD_S; `period=0.6` with factor 2 is stopped 300 ms, run 300 ms). The cgroup quota
itself is the `quota` fault (cpu_quota.py). It goes on until the worker exits; the worker is
always left running (SIGCONT) when it stops.

This module must never signal a process other than the target worker.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from transom.common import anomaly_types
from transom.common.fault_spec import Fault
from transom.faults.fault_type import AGENT, AgentTarget, FaultType

THROTTLE_PERIOD_S = 0.1  # the CFS bandwidth controller's default period
PERIOD_RANGE_S = (0.01, 10.0)


def throttle(
    pid: int, run_fraction: float, period_s: float = THROTTLE_PERIOD_S
) -> threading.Thread:
    """Start stopping and continuing `pid` so it runs `run_fraction` of each period; the thread
    ends when the process is gone (reaped)."""
    stopped_s = period_s * (1.0 - run_fraction)
    running_s = period_s * run_fraction

    def cycle() -> None:
        try:
            while True:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(stopped_s)
                os.kill(pid, signal.SIGCONT)
                time.sleep(running_s)
        except ProcessLookupError:
            return
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    thread = threading.Thread(target=cycle, name=f"transom-throttle-{pid}", daemon=True)
    thread.start()
    return thread


class Throttle(FaultType):
    """From its step on, the rank runs 1/FACTOR of the time (stopped and continued from outside)."""

    name = "throttle"
    where = AGENT
    detected_by = (anomaly_types.STRAGGLER,)
    description = "a worker is throttled from outside its process to 1/FACTOR of the CPU time"

    def note(self, fault: Fault) -> str:
        return f" (runs 1/{fault.factor:g} of each {self.period(fault) * 1000:g} ms)"

    def validate(self, fault: Fault) -> str | None:
        if fault.period is not None and not PERIOD_RANGE_S[0] <= fault.period <= PERIOD_RANGE_S[1]:
            return f"period must be {PERIOD_RANGE_S[0]:g}-{PERIOD_RANGE_S[1]:g} seconds"
        return None if fault.factor > 1.0 else "factor must be above 1"

    def fire_agent(self, fault: Fault, target: AgentTarget) -> None:
        throttle(target.pid, 1.0 / float(fault.factor), self.period(fault))

    @staticmethod
    def period(fault: Fault) -> float:
        return THROTTLE_PERIOD_S if fault.period is None else float(fault.period)

    def describe(self, fault: Fault) -> str:
        return f"a worker is throttled from outside to 1/{fault.factor:g} of the CPU time"
