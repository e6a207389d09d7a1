"""What a node agent writes about its node, and when: its status, monitor summary and events.

Every write is an etcd request on every node, so each is made when the controller has something
new to learn from it, or at a slow heartbeat, never on a timer alone:
- `status/<node>`: at once when the node's state or its facts (pids, failures) change, but a
  transient state only if it lasts (`status(quiet_s=...)`: a member waiting for its master's
  address is STARTING only after STARTING_QUIET_S; it starts before that on nearly every restart,
  and a thousand nodes then write one status each, not two). Its
  step and warm interpreter count only people read (`transom status`, the launcher's progress
  bar and progress.jsonl; the controller acts on states). The step is written at once for a
  generation's first step, when training is back (the run report's recovery time), and not
  after: the node's monitor summary carries its newest step (transom.view.node_step reads it
  there), so a thousand nodes do not rewrite their status every few seconds for a progress
  bar. The warm interpreter count: when it changes, at most every STATUS_PROGRESS_S.
- `monitor/<node>`: at once when it carries something the controller acts on (a new anomaly,
  the generation, the ranks, a phase, a rank's first step, a rank's heartbeat stopping or
  coming back), or when a rank advanced SUMMARY_STEPS steps (at most every
  SUMMARY_MIN_PERIOD_S; transom.monitor.node), whose timings the straggler detector needs, as
  it counts its latency in steps (on a job of 1 s steps: every 4 s); otherwise only when
  `_allowance` of the last written one is used up. The
  controller ages a summary on its own clock from when it saw it change
  (transom.control.observed) and adds that age to the summary's step and heartbeat ages
  (transom.monitor.detectors.rank_views), except while the agent said a rank steps or beats:
  those age only once SUMMARY_HEARTBEAT_S ran out, as the agent writes at once when a rank
  stops stepping (detectors.stepping) or its beat stops. The allowance keeps that view true
  enough: never a false hang (while a rank with a step is not stepping, half the hang floor, 1 s
  at least), never a stopped heartbeat of a rank that beats (detectors.HEARTBEAT_GAP_S), never
  a telemetry gap (monitor_rules.SUMMARY_GAP_S, 11 s); and it is never shorter than
  SUMMARY_FLOOR_S, the period every summary was written at before issue 44.
- events (the anomalies'): with the summary that announces them.
What an agent's turn queues (`batch`: its status, summary and events) is written together at the
turn's end, in one request.
During an outage the newest of each waits and is written when etcd is back (`flush`): while
`held` (the agent knows etcd does not answer, or a write just failed) nothing is tried, so a
cut-off agent never spends its loop waiting on writes that cannot succeed (its fence rule must
run every tick); `failure` is the write that failed since the agent last cleared it.

It never reads etcd and decides nothing; StoreError from `flush` is the caller's outage.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from transom.common import keys
from transom.common.records import Event, MonitorSummary, NodeStatus
from transom.common.states import NodeState
from transom.monitor.detectors import BEAT_STOPPED_S, SUMMARY_KEEPALIVE_S, stepping
from transom.monitor.summary_pace import SUMMARY_PERIOD_S
from transom.store import Store, StoreError

# A summary that says nothing new is written at most this often (every 8 s, not 2: issue 44).
# The controller ages a beating rank's heartbeat only from when this keep-alive runs out
# (detectors.rank_views), and the telemetry-gap bound is this and 3 s
# (monitor_rules.SUMMARY_GAP_S).
SUMMARY_HEARTBEAT_S = SUMMARY_KEEPALIVE_S
SUMMARY_FLOOR_S = SUMMARY_PERIOD_S
# A changed warm interpreter count (for people only) is written at most this often.
STATUS_PROGRESS_S = 5.0
# A member waiting for its generation's master address is reported STARTING only this long
# after: the address normally arrives with the plan's watch a few ticks later.
STARTING_QUIET_S = 1.0


def signature(summary: MonitorSummary) -> tuple[Any, ...]:
    """What in a summary the controller must see at once (all but progress, timings, ages)."""
    return (
        summary.generation,
        tuple(a.id for a in summary.anomalies),
        tuple(
            (
                rank,
                r.phase,
                r.step is None,
                r.beat_age is None or r.beat_age >= BEAT_STOPPED_S,
                stepping(r),
                r.where,
            )
            for rank, r in sorted(summary.ranks.items())
        ),
    )


def allowance(summary: MonitorSummary, hang_floor_s: float) -> float:
    """How long `summary` may stand before the next must be written (see the module doc): the
    keep-alive while every rank with a step is stepping, else half the hang floor at most."""
    steady = all(stepping(r) for r in summary.ranks.values() if r.step is not None)
    cap = SUMMARY_HEARTBEAT_S if steady else min(SUMMARY_HEARTBEAT_S, hang_floor_s / 2)
    return max(SUMMARY_FLOOR_S, cap)


class NodeReports:
    """The agent's writes about its node. `facts()` gives (generation, newest step, warm
    interpreters) at the moment a status is written."""

    def __init__(
        self,
        store: Store,
        node_id: str,
        incarnation: str,
        facts: Callable[[], tuple[int, int | None, int]],
    ) -> None:
        self.store = store
        self.node_id = node_id
        self.incarnation = incarnation
        self.hang_floor_s = math.inf  # the job spec's, once the agent has read it
        self.facts = facts
        self.state = NodeState.IDLE
        self.extra: dict[str, Any] = {}
        self.writes = 0  # records written (statuses, summaries, events)
        self.held = False  # etcd does not answer: queue everything, write nothing
        self.failure: StoreError | None = None
        self._status_pending = False  # the newest status did not reach etcd yet
        # (generation, step, warm) last written
        self._status_shown: tuple[int, int | None, int] = (0, None, 0)
        self._status_at = -math.inf
        self._status_after = -math.inf  # a transient status waits until then (time.monotonic)
        self._batching = False  # inside `batch`: statuses wait for its end
        self._unsent: dict[str, dict[str, Any]] = {}  # key -> value: monitor writes that await etcd
        self._summary_signature: tuple[Any, ...] | None = None
        self._summary_at = -math.inf
        self._summary_allowance = SUMMARY_FLOOR_S

    # -- status --------------------------------------------------------------------------------
    def status(self, state: NodeState, quiet_s: float = 0.0, **extra: Any) -> None:
        """Publish the node's state: at the end of a `batch`, else now; with `quiet_s` (a
        transient state) only if no other status replaced it that long after; during an outage
        when etcd is back."""
        self.state, self.extra = state, extra
        self._status_pending = True
        self._status_after = time.monotonic() + quiet_s if quiet_s > 0 else -math.inf
        if not self._batching:
            self.write_now()

    @contextmanager
    def batch(self) -> Iterator[None]:
        """What is queued inside (statuses, summaries, events) is written together when it ends
        (one request), unless it raised; a failed write leaves `held` and `failure` set."""
        self._batching = True
        try:
            yield
        finally:
            self._batching = False
        self.write_now()

    def write_now(self) -> None:
        """`flush`, even inside a `batch` (news that must not wait for the rest of a turn); a
        failed write leaves `held` and `failure` set."""
        try:
            self.flush()
        except StoreError:
            pass  # held: written when etcd is back; `failure` says why

    def progress(self, now: float) -> None:
        """Re-publish the status at the generation's first step (at once), or when the warm
        interpreter count changed (now and then); a later step alone is the summaries'."""
        facts = self.facts()
        if facts == self._status_shown or self.state not in (NodeState.RUNNING, NodeState.SPARE):
            return
        generation, step, warm = facts
        shown_generation, shown_step, shown_warm = self._status_shown
        first_step = step is not None and (shown_step is None or shown_generation != generation)
        if first_step or (warm != shown_warm and now - self._status_at >= STATUS_PROGRESS_S):
            self.status(self.state, **self.extra)

    def _status_value(self, facts: tuple[int, int | None, int]) -> dict[str, Any]:
        generation, step, warm = facts
        status = NodeStatus(
            node=self.node_id,
            generation=generation,
            state=self.state,
            time=time.time(),
            step=step,
            warm=warm,
            incarnation=self.incarnation,
            **self.extra,
        )
        return status.to_dict()

    # -- monitor summaries ---------------------------------------------------------------------
    def summary_due(self, now: float) -> bool:
        """Whether the last summary written has used up its allowance."""
        return now - self._summary_at >= self._summary_allowance

    def summary(
        self, summary: MonitorSummary, events: list[Event], now: float, progress: bool = False
    ) -> None:
        """Queue `summary` (if it is to be written now) and `events`; `flush` writes them.
        `progress`: its ranks advanced enough steps that the controller's straggler detector,
        which counts in steps, needs their timings now (monitor.node.NodeMonitor.steps_due)."""
        for event in events:
            self._unsent[keys.event(event.time, f"{self.node_id}-{event.id}")] = event.to_dict()
        new = signature(summary)
        if events or progress or new != self._summary_signature or self.summary_due(now):
            self._unsent[keys.monitor(self.node_id)] = summary.to_dict()
            self._summary_signature = new
            self._summary_at = now
            self._summary_allowance = allowance(summary, self.hang_floor_s)

    def flush(self) -> None:
        """Write what waits, unless `held`: the status (a transient one once it is due), the
        monitor summary and events, in one request. StoreError: etcd could not be reached (now
        `held`; everything waits)."""
        if self.held:
            return
        writes = dict(self._unsent)
        facts = None  # (generation, step, warm) of a status written now
        if self._status_pending and time.monotonic() >= self._status_after:
            facts = self.facts()
            # Not leased: the last status of a dead node stays readable; liveness is `nodes/`.
            writes[keys.status(self.node_id)] = self._status_value(facts)
        if not writes:
            return
        try:
            if len(writes) == 1:
                [(key, value)] = writes.items()
                self.store.put(key, value)
            else:
                self.store.write_all({key: (value, None) for key, value in writes.items()})
        except StoreError as e:
            self.held, self.failure = True, e
            raise
        self.writes += len(writes)
        for key, value in writes.items():
            if self._unsent.get(key) is value:
                del self._unsent[key]
        if facts is not None:
            self._status_pending = False
            self._status_shown = facts
            self._status_at = time.monotonic()
