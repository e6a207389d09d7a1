"""`PlanFollower`: the job's plan, and each generation's rendezvous address, as a node agent
knows them, pushed to it by one etcd watch.

An agent used to read the plan every tick: five requests a second a node, to learn of the few
plans a job ever has. It now follows the `plan` key through a `KeyFollower`
(transom.store.key_follow: read once, then pushed by etcd, read directly only while the watch
stream is down, `resync()` after an outage and before the agent takes a lost lease again, so an
eviction is never missed), and parses each new plan once.

The master node's agent publishes the generation's rendezvous address under the plan's name
(`keys.master`, `plan/master/<gen>`), so the same stream pushes it to every member: the others
start their workers the moment it arrives, with no read of their own (they used to read it
every tick until it appeared: a thousand nodes' polls at once on every restart).

The controller's requests for fresh monitor summaries (`keys.SUMMARY_REQUEST`, a NaN's hold
waiting to learn every rank's step) come the same way: `summary_request()`.

It only reads etcd; a direct read that fails raises StoreError to the caller (an outage).
"""

from __future__ import annotations

import logging
from typing import Any

from transom.common import keys
from transom.common.records import MasterAddress, Plan, RecordError, SummaryRequest
from transom.store import Store
from transom.store.key_follow import KeyFollower
from transom.store.watch import Update

log = logging.getLogger("transom.agent")

MASTER_NAME = keys.MASTER[len(keys.PLAN) :]  # a master key's name under the plan's
REQUEST_NAME = keys.SUMMARY_REQUEST[len(keys.PLAN) :]  # the summary request's


class PlanFollower(KeyFollower):
    def __init__(self, store: Store) -> None:
        super().__init__(store, keys.PLAN)
        self._parsed: tuple[int, Plan | None] = (-1, None)  # (revision, its plan)
        self._masters: dict[int, Any] = {}  # generation -> its published address, unparsed
        self._request: Any = None  # the newest summary request, unparsed

    def current(self, now: float) -> Plan | None:
        """The newest plan known (None: none yet, or an invalid one, logged once)."""
        self.refresh(now)
        revision, plan = self._parsed
        if revision != self.revision:
            plan = None
            if self.value is not None:
                try:
                    plan = Plan.from_dict(self.value)
                except RecordError as e:
                    log.warning("ignoring an invalid plan: %s", e)
            self._parsed = (self.revision, plan)
            if plan is not None:  # the addresses of generations before this one are done
                self._masters = {g: v for g, v in self._masters.items() if g >= plan.generation}
        return plan

    def master(self, generation: int) -> MasterAddress | None:
        """Generation `generation`'s rendezvous address, once its master node published it
        (None: not yet, or an invalid one, logged and dropped), as of the last `current()`
        or `wait()`."""
        value = self._masters.get(generation)
        if value is None:
            return None
        try:
            return MasterAddress.from_dict(value)
        except RecordError as e:
            log.warning("ignoring an invalid master address for generation %d: %s", generation, e)
            del self._masters[generation]
            return None

    def summary_request(self) -> SummaryRequest | None:
        """The controller's newest request for fresh summaries, as of the last `current()` or
        `wait()` (None: none, or an invalid one, logged and dropped)."""
        if self._request is None:
            return None
        try:
            return SummaryRequest.from_dict(self._request)
        except RecordError as e:
            log.warning("ignoring an invalid summary request: %s", e)
            self._request = None
            return None

    def _take_read(self, values: dict[str, Any], revision: int) -> None:
        super()._take_read(values, revision)
        for name, value in values.items():
            self._take_named(name, value)

    def _apply(self, update: Update) -> None:
        super()._apply(update)
        for name, value in (update.snapshot or {}).items():
            self._take_named(name, value)
        for event in update.events:
            if not event.deleted:
                self._take_named(event.name, event.value)

    def _take_named(self, name: str, value: Any) -> None:
        """Keep `value` if `name` is the summary request or a master key (dropped once a newer
        plan arrives, whatever else was written under the name: the current generation's is
        never pushed out)."""
        if name == REQUEST_NAME:
            self._request = value
            return
        if not name.startswith(MASTER_NAME):
            return
        try:
            generation = int(name[len(MASTER_NAME) :])
        except ValueError:
            return  # not a key this version writes
        self._masters[generation] = value
