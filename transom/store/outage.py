"""`StoreOutage`: one process's view of an etcd outage: when it began, how long it has lasted.

A caller reports each etcd round as `failed(error)` or `ok()`. The outage is logged once when
it begins (with its reason) and once when it ends (with its duration), never once a round, and
`over(limit_s)` says whether it has lasted longer than the caller can ride out. Durations are
on this process's monotonic clock. This module only keeps time and logs; it must never decide
what an outage costs (its caller does, deliberately).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("transom.store")


class StoreOutage:
    """The current outage of etcd as `who` sees it (none while `since` is None)."""

    def __init__(
        self,
        who: str,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ):
        self.who = who
        self.clock = clock
        self.log = logger
        self.since: float | None = None
        self.reason = ""

    def failed(self, error: BaseException, began: float | None = None) -> float:
        """Record a failed round (that `began` at this clock's time, default now); how long
        the outage has lasted, from the start of its first failed round."""
        now = self.clock()
        if self.since is None:
            self.since, self.reason = (now if began is None else began), str(error)
            self.log.warning("%s: etcd unreachable (%s); riding it out", self.who, error)
        return now - self.since

    def ok(self) -> float | None:
        """Record a round that worked; the duration of the outage it ended, if one."""
        if self.since is None:
            return None
        lasted = self.clock() - self.since
        self.since = None
        self.log.warning("%s: etcd reachable again after %.1f s", self.who, lasted)
        return lasted

    def lasted(self) -> float:
        return 0.0 if self.since is None else self.clock() - self.since

    def over(self, limit_s: float) -> bool:
        return self.since is not None and self.clock() - self.since > limit_s
