"""Fault injection (chaos testing): a seeded schedule of real faults, fired through one hook.

Layout:
  fault_type.py      what a fault type is (FaultType) and where faults apply; a scheduled
                     fault is a `Fault` (transom.common.fault_spec)
  agent_side.py      crash, hang, log, kill: the node agent applies them
  worker_side.py     slow, nan: the worker applies them through the monitor API
  preflight_side.py  slow_preflight, slow_link: a node whose pre-flight compute benchmark or
                     link test is slow
  throttle.py        throttle: the agent stops and continues a worker with a duty cycle
  registry.py        FAULT_TYPES (name -> type) and DETECTORS (fault type -> anomaly types)
  schedule.py        parsing and validating `--faults`, random schedules
  injector.py        the agent's hooks (FaultInjector)
  worker.py          the worker's hooks (WorkerFaults), called by transom.monitor
  mock_nvml.py       MockNvml: GPU counters set by a test, for machines without a GPU
A new fault type is one class and one line in registry.py. This package must never fire a fault
that is not in the schedule, and must never import the controller or the monitor.
"""

from transom.common.fault_spec import DEFAULT_LOG_LINE, Fault
from transom.faults.fault_type import NODE_LOST, PREFLIGHT_EXCLUSION, FaultType
from transom.faults.injector import FaultInjector
from transom.faults.mock_nvml import MockNvml
from transom.faults.registry import (
    AGENT_FAULTS,
    DETECTORS,
    FAULT_TYPES,
    PREFLIGHT_FAULTS,
    RANDOM_TYPES,
    WORKER_FAULTS,
)
from transom.faults.schedule import parse_schedule
from transom.faults.worker import WorkerFaults, parse_worker_faults

__all__ = [
    "AGENT_FAULTS",
    "DEFAULT_LOG_LINE",
    "DETECTORS",
    "FAULT_TYPES",
    "NODE_LOST",
    "PREFLIGHT_EXCLUSION",
    "PREFLIGHT_FAULTS",
    "RANDOM_TYPES",
    "WORKER_FAULTS",
    "Fault",
    "FaultInjector",
    "FaultType",
    "MockNvml",
    "WorkerFaults",
    "parse_schedule",
    "parse_worker_faults",
]
