"""The agent's side of fault injection: the hooks the node agent calls.

    injector = FaultInjector(store, node_id, spec.faults)
    slowdown = injector.on_preflight()                            # when the node joins
    injector.link_delay_s                                           # set by on_preflight
    env[FAULTS] = injector.on_generation(generation, local_ranks)   # when workers start
    injector.on_agent_tick(steps, pids, log_paths)                  # every agent tick
    injector.write_held()                                           # every agent tick
    injector.on_worker_fired(fault, rank, step, when)               # a worker says it fired one

A fault fires once in the whole job, across restarts: the first firing creates
`faults/fired/<id>` in etcd and writes a `fault` event with its time, type, node, rank and step.
A type that `holds_later` (the quota) gets its event once it holds, with that time and the step
the agent last saw before it (never a step beyond the one in flight).
This module must never fire a fault that is not in the schedule.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from functools import partial
from pathlib import Path

from transom.common import keys
from transom.common.fault_spec import Fault
from transom.common.record_base import RecordError
from transom.faults.fault_type import AGENT, PREFLIGHT, WORKER, AgentTarget
from transom.faults.registry import FAULT_TYPES
from transom.faults.schedule import read_fault

EVENT_SOURCE_SUFFIX = "-fault"
SEEN_TICKS = 4  # the ticks' steps kept to name the step at which a late fault took hold


class FaultInjector:
    """Fires the schedule's faults aimed at this node once their step (or place) is reached."""

    def __init__(self, store, node_id: str, schedule: list[Fault]):
        self.store = store
        self.node_id = node_id
        self.generation = 0
        self.schedule = list(schedule)
        self.fired: set[str] = set()
        self.link_delay_s = 0.0  # each pre-flight link-test send waits this long (slow_link)
        self.awaiting: set[str] = set()  # fired faults that hold later, not yet held
        self._held: list[tuple[Fault, int, float, str | None]] = []  # from their threads
        self._held_lock = threading.Lock()
        self._seen: deque[tuple[float, dict[int, int | None]]] = deque(maxlen=SEEN_TICKS)

    def _where(self, fault: Fault) -> str:
        return FAULT_TYPES[fault.type].where

    def _targets_here(self, fault: Fault, local_ranks: list[int]) -> list[int]:
        if fault.node is not None:
            return local_ranks if fault.node == self.node_id else []
        return [fault.rank] if fault.rank in local_ranks else []

    def _refresh_fired(self) -> None:
        if self.schedule:
            self.fired = set(self.store.get_prefix(keys.FAULTS_FIRED))

    def agent_faults_left(self) -> bool:
        """Whether an agent-side fault that may be this node's has yet to fire (the agent then
        ticks at its quicker pace, so that it fires close to its step)."""
        return bool(self.awaiting) or any(
            self._where(f) == AGENT and f.id not in self.fired and f.node in (None, self.node_id)
            for f in self.schedule
        )

    # -- hooks ----------------------------------------------------------------------------------
    def on_preflight(self) -> float:
        """How many times slower this node's compute benchmark must run (1.0: no fault)."""
        self._refresh_fired()
        slowdown = 1.0
        for f in self.schedule:
            if (
                self._where(f) == PREFLIGHT
                and f.node == self.node_id
                and self._record(f, None, None)
            ):
                slowdown = max(slowdown, FAULT_TYPES[f.type].preflight_slowdown(f))
                self.link_delay_s = max(
                    self.link_delay_s, FAULT_TYPES[f.type].preflight_link_delay_s(f)
                )
        return slowdown

    def on_generation(self, generation: int, local_ranks: list[int]) -> str:
        """The workers' FAULTS value: unfired worker-side faults for this node's ranks (JSON)."""
        self._refresh_fired()
        self.generation = generation
        out = []
        for f in self.schedule:
            if self._where(f) == WORKER and f.id not in self.fired:
                out += [{**f.to_dict(), "rank": r} for r in self._targets_here(f, local_ranks)]
        return json.dumps(out)

    def on_agent_tick(
        self, steps: dict[int, int | None], pids: dict[int, int], log_paths: dict[int, Path]
    ) -> None:
        """Fire every agent-side fault whose target rank has reported its trigger step."""
        self._seen.append((time.time(), dict(steps)))
        for f in self.schedule:
            if self._where(f) != AGENT or f.id in self.fired:
                continue
            for rank in self._targets_here(f, sorted(steps)):
                step = steps.get(rank)
                if step is None or step < f.step:
                    continue
                kind = FAULT_TYPES[f.type]
                target = AgentTarget(pids[rank], log_paths[rank])
                if kind.holds_later and self._claim(f, rank, step):
                    self.awaiting.add(f.id)
                    target.took_hold = partial(self._took_hold, f, rank)
                    kind.fire_agent(f, target)
                elif not kind.holds_later and self._record(f, rank, step):
                    kind.fire_agent(f, target)  # after the event: a kill takes the agent along
                break

    def _took_hold(self, fault: Fault, rank: int, when: float, failure: str | None) -> None:
        with self._held_lock:
            self._held.append((fault, rank, when, failure))

    def write_held(self) -> None:
        """Write the events of the faults that took hold since the last call (the agent's
        thread: the faults' own threads only queue them)."""
        with self._held_lock:
            held, self._held = self._held, []
        for fault, rank, when, failure in held:
            self.awaiting.discard(fault.id)
            self._write_event(fault, rank, self._step_before(rank, when), when, failure)

    def _step_before(self, rank: int, when: float) -> int | None:
        """The step `rank` had reported at the last tick before `when` (the oldest kept tick's
        when none was before)."""
        before = [steps for seen, steps in self._seen if seen <= when] or [self._seen[0][1]]
        return before[-1].get(rank)

    def on_worker_fired(
        self, fault: dict, rank: int | None, step: int | None, when: float | None = None
    ) -> bool:
        """A worker reports that it fired `fault` (a datagram: checked against the schedule)."""
        try:
            reported = read_fault(fault)
        except RecordError:
            return False
        scheduled = next((f for f in self.schedule if f.id == reported.id), None)
        if scheduled is None or scheduled.type != reported.type:
            return False
        return self._record(scheduled, rank, step, when)

    # -- the record of a firing -----------------------------------------------------------------
    def _record(
        self, fault: Fault, rank: int | None, step: int | None, when: float | None = None
    ) -> bool:
        """Mark `fault` fired (False if it already was) and write its `fault` event."""
        if not self._claim(fault, rank, step):
            return False
        self._write_event(fault, rank, step, when or time.time())
        return True

    def _claim(self, fault: Fault, rank: int | None, step: int | None) -> bool:
        """Mark `fault` fired in etcd: True for the one caller in the whole job that fires it."""
        if fault.id in self.fired:
            return False
        self.fired.add(fault.id)
        return self.store.create(
            keys.fault_fired(fault.id), {"node": self.node_id, "rank": rank, "step": step}
        )

    def _write_event(
        self,
        fault: Fault,
        rank: int | None,
        step: int | None,
        when: float,
        failure: str | None = None,
    ) -> None:
        where = f" rank {rank} at step {step}" if rank is not None or step is not None else ""
        note = f" (not played: {failure})" if failure else FAULT_TYPES[fault.type].note(fault)
        self.store.put(
            keys.event(when, self.node_id + EVENT_SOURCE_SUFFIX),
            {
                "time": when,
                "kind": "fault",
                "fault": fault.type,
                "generation": self.generation,
                "id": fault.id,
                "node": self.node_id,
                "rank": rank,
                "step": step,
                "message": f"injected {fault.type} on {self.node_id}{where}{note}",
            },
        )
