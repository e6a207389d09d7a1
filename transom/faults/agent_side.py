"""Fault types the node agent applies to its workers (or itself): crash, hang, log, kill.

This module must never act on a process other than the target worker or, for `kill`, the agent.
"""

from __future__ import annotations

import os
import signal

from transom.common import anomaly_types
from transom.common.fault_spec import Fault
from transom.faults.fault_type import AGENT, NODE_LOST, AgentTarget, FaultType


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class Crash(FaultType):
    name = "crash"
    where = AGENT
    detected_by = (anomaly_types.CRASH,)
    description = "a worker is SIGKILLed"
    in_random = True

    def fire_agent(self, fault: Fault, target: AgentTarget) -> None:
        _signal(target.pid, signal.SIGKILL)


class Hang(FaultType):
    name = "hang"
    where = AGENT
    detected_by = (anomaly_types.HANG,)
    description = "a worker freezes (SIGSTOP): its peers wait in the all-reduce"
    in_random = True

    def fire_agent(self, fault: Fault, target: AgentTarget) -> None:
        _signal(target.pid, signal.SIGSTOP)


class LogLine(FaultType):
    """A line appended to the worker's log as if it printed it (default: an Xid error)."""

    name = "log"
    where = AGENT
    detected_by = anomaly_types.HARDWARE
    description = "a hardware error (Xid) appears in a worker's log"
    in_random = True

    def fire_agent(self, fault: Fault, target: AgentTarget) -> None:
        with open(target.log_path, "a") as log:
            log.write(fault.line + "\n")


class Kill(FaultType):
    """A node death: the agent SIGKILLs itself, and its workers die with it."""

    name = "kill"
    where = AGENT
    detected_by = (NODE_LOST,)
    description = "a node dies (its agent and workers SIGKILLed)"

    def fire_agent(self, fault: Fault, target: AgentTarget) -> None:
        os.kill(os.getpid(), signal.SIGKILL)
