"""`StoreOutage`: the one definition of "etcd is unreachable", as one process sees it.

Every process that rides out etcd's outages (the launcher, each node agent) keeps one. The
caller reports each round with etcd as `ok()` or `failed(error)`. An outage begins when etcd
last answered (or, if the caller says so, when its first failed round began) and ends with the
next round that works; `lasted()` is its length so far and `over(limit_s)` whether it is longer
than the caller can ride out. It is logged once when it begins (with its reason and what the
caller does meanwhile) and once when it ends (with its duration), never once a round. Times are
on this process's monotonic clock, never compared with another machine's clock.

This module only keeps time and logs; it must never call etcd and never decide what an outage
costs (its caller does, deliberately: the launcher ends the job past `--store-outage`, an agent
applies its fence rule, transom.control.fence).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("transom.store")


class StoreOutage:
    """The current outage of etcd as `who` sees it (none while `since` is None).

    `meanwhile`: what `who` does during an outage, said in the log line that opens one."""

    def __init__(
        self,
        who: str,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
        meanwhile: str = "riding it out",
    ):
        self.who = who
        self.clock = clock
        self.log = logger
        self.meanwhile = meanwhile
        self.last_ok = clock()  # when etcd last answered (at first: when the process began)
        self.since: float | None = None
        self.reason = ""

    @property
    def in_outage(self) -> bool:
        return self.since is not None

    def failed(self, error: BaseException, began: float | None = None) -> float:
        """Record a failed round; how long the outage has lasted. A new outage began when etcd
        last answered, or at `began` (this clock's time the failed round began) if given."""
        now = self.clock()
        if self.since is None:
            self.since, self.reason = (self.last_ok if began is None else began), str(error)
            self.log.warning("%s: etcd unreachable (%s); %s", self.who, error, self.meanwhile)
        return now - self.since

    def ok(self, at: float | None = None) -> float | None:
        """Record a round that worked (etcd answered at `at` on this clock, default now); the
        duration of the outage it ended, if one."""
        now = self.clock() if at is None else at
        self.last_ok = max(self.last_ok, now)
        if self.since is None:
            return None
        lasted, self.since = now - self.since, None
        self.log.warning("%s: etcd reachable again after %.1f s", self.who, lasted)
        return lasted

    def lasted(self) -> float:
        return 0.0 if self.since is None else self.clock() - self.since

    def over(self, limit_s: float) -> bool:
        return self.since is not None and self.clock() - self.since > limit_s
