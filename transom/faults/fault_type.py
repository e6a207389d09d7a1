"""What a fault type is: where it applies, how it fires, what detects it.

Each fault type is one subclass of `FaultType` (agent_side.py, worker_side.py, preflight_side.py)
plus one registration line in registry.py; a scheduled fault is a `Fault`
(transom.common.fault_spec). Three places apply faults, each through one hook:
  AGENT      the node agent, every tick (`FaultInjector.on_agent_tick`): signals, log lines
  WORKER     the worker, through the monitor API (`WorkerFaults.on_step` / `on_loss`)
  PREFLIGHT  the agent's pre-flight benchmark, when the node joins (`FaultInjector.on_preflight`)
This module must never fire anything itself: it only defines the interface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from transom.common.fault_spec import Fault

AGENT = "agent"
WORKER = "worker"
PREFLIGHT = "preflight"
# Worker hooks: when a step begins, or when the worker hands its loss to the monitor.
ON_STEP = "step"
ON_LOSS = "loss"
# What detects a node death: the controller finds the node lost (no anomaly has this type).
NODE_LOST = "node lost"
# What detects a slow node at pre-flight: the controller excludes it (an `evict` event that
# carries the node's pre-flight result), before training.
PREFLIGHT_EXCLUSION = "pre-flight exclusion"


@dataclass
class AgentTarget:
    """The worker an agent-side fault hits: its process and its log file. A type that
    `holds_later` calls `took_hold(time, None)` once the fault is in effect, or
    `took_hold(time, why)` when it could not be played (from any thread)."""

    pid: int
    log_path: Path
    took_hold: Callable[[float, str | None], None] = lambda when, failure: None


@dataclass
class WorkerState:
    """What worker-side faults change in the worker: how much slower its compute runs, and how
    many bits of its parameters are still to flip (applied after its next optimizer step)."""

    slow_factor: float = 1.0
    corrupt_bits: int = 0


class FaultType:
    """One kind of fault. Subclasses set the class attributes and override the hook of `where`."""

    name: ClassVar[str]
    where: ClassVar[str]  # AGENT | WORKER | PREFLIGHT
    detected_by: ClassVar[tuple[str, ...]]  # anomaly types (or NODE_LOST) that find it
    description: ClassVar[str]  # what happens, in words (the demo and --help show it)
    worker_hook: ClassVar[str] = ON_STEP  # WORKER types: when they fire
    needs_step: ClassVar[bool] = True  # False: fires when its place is reached, step ignored
    in_random: ClassVar[bool] = False  # drawn by `random` schedules
    # AGENT types whose fire_agent only starts the fault (the quota first measures the rank's CPU
    # for a second): the fault event then carries the time it took hold, not the time it fired.
    holds_later: ClassVar[bool] = False

    def validate(self, fault: Fault) -> str | None:
        """Why `fault` is not valid for this type, or None."""
        return None

    def fire_agent(self, fault: Fault, target: AgentTarget) -> None:
        """AGENT types: do it to the target worker (or to the agent itself)."""
        raise NotImplementedError

    def fire_worker(self, fault: Fault, state: WorkerState, value: Any) -> Any:
        """WORKER types: change `state`, or return a changed `value` (the loss for ON_LOSS)."""
        return value

    def preflight_slowdown(self, fault: Fault) -> float:
        """PREFLIGHT types: how many times slower the node's compute benchmark runs."""
        return 1.0

    def preflight_link_delay_s(self, fault: Fault) -> float:
        """PREFLIGHT types: the delay added to each of the node's link-test sends."""
        return 0.0

    def describe(self, fault: Fault) -> str:
        return self.description

    def note(self, fault: Fault) -> str:
        """What the `fault` event's message adds after the target (e.g. a factor)."""
        return ""
