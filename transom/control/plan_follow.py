"""`PlanFollower`: the job's plan as a node agent knows it, pushed to it by an etcd watch.

An agent used to read the plan every tick: five requests a second a node, to learn of the few
plans a job ever has. It now follows the `plan` key through a `KeyFollower`
(transom.store.key_follow: read once, then pushed by etcd, read directly only while the watch
stream is down, `resync()` after an outage and before the agent takes a lost lease again, so an
eviction is never missed), and parses each new plan once.

It only reads etcd; a direct read that fails raises StoreError to the caller (an outage).
"""

from __future__ import annotations

import logging

from transom.common import keys
from transom.common.records import Plan, RecordError
from transom.store import Store
from transom.store.key_follow import KeyFollower

log = logging.getLogger("transom.agent")


class PlanFollower(KeyFollower):
    def __init__(self, store: Store) -> None:
        super().__init__(store, keys.PLAN)
        self._parsed: tuple[int, Plan | None] = (-1, None)  # (revision, its plan)

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
        return plan
