"""`EtcdUpkeep`: keeps the etcd a job owns (the embedded one) from filling up.

etcd compacts its history by itself (embedded.py turns auto-compaction on), but compaction
only marks pages free: the database file keeps its size until it is defragmented, and a
database that reaches its quota raises the NOSPACE alarm, after which etcd refuses every write
until someone compacts, defragments and disarms it. A thread checks every `check_every_s` while
the database is past half its quota, every ROOMY_FACTOR times that while it is not (it cannot
fill half a quota in 30 s at what a job writes: a 30-minute benchmark wrote 352 MiB), with one
request (etcd's status names its raised alarms among its `errors`):

- NOSPACE alarm: compact to the current revision, defragment, disarm; an event says so (the
  writers' retries carry them over the few seconds this takes, see retry.py);
- otherwise it defragments every `defrag_every_s`, or sooner when more than a quarter of the
  quota is free pages.

It talks to etcd only through its HTTP gateway's maintenance calls. It must never run against
an etcd the job does not own (an external etcd has operators of its own), and never start or
stop etcd (the launcher restarts a dead one, from the thread that owns it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transom.common import keys
from transom.common.records import Event, EventKind
from transom.store.access import StoreError
from transom.store.etcd_client import Store

log = logging.getLogger("transom.store")

CHECK_EVERY_S = 5.0
# While the database is under half its quota, checks are this many times further apart (every
# 30 s by default, not 5: issue 44, the launcher's share of a small job's etcd requests).
ROOMY_FACTOR = 6
DEFRAG_EVERY_S = 600.0
SOURCE = "etcd-upkeep"
NOSPACE = "NOSPACE"


@dataclass(frozen=True)
class EtcdStatus:
    """What etcd says of itself (its maintenance status): sizes in bytes."""

    revision: int
    member: int
    db_size: int
    db_in_use: int
    full: bool  # a NOSPACE alarm is raised (etcd lists it in `errors` as "... alarm:NOSPACE")


class EtcdUpkeep:
    """Compaction, defragmentation and NOSPACE handling for one etcd of `quota_bytes`."""

    def __init__(
        self,
        store: Store,
        quota_bytes: int,
        check_every_s: float = CHECK_EVERY_S,
        defrag_every_s: float = DEFRAG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store = store
        self.quota_bytes = quota_bytes
        self.check_every_s = check_every_s
        self.defrag_every_s = defrag_every_s
        self.clock = clock
        self.last_defrag = clock()
        self.freed: list[tuple[int, int]] = []  # each NOSPACE alarm: db size before, after
        self.defrags = 0
        self.wait_s = check_every_s  # until the next pass (`check` sets it)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def alarms_handled(self) -> int:
        return len(self.freed)

    # -- one pass -----------------------------------------------------------------------------
    def status(self) -> EtcdStatus:
        """etcd's status, from its maintenance/status answer (the gateway's JSON: 64-bit numbers
        come as strings)."""
        answer = self.store.request("maintenance/status", {})
        header = answer.get("header", {})
        errors = answer.get("errors") or []
        return EtcdStatus(
            revision=int(header.get("revision", 0)),
            member=int(header.get("member_id", 0)),
            db_size=int(answer.get("dbSize", 0)),
            db_in_use=int(answer.get("dbSizeInUse", 0) or answer.get("dbSize", 0)),
            full=any(f"alarm:{NOSPACE}" in str(e) for e in errors),
        )

    def check(self) -> list[str]:
        """One pass; what it did, in words (nothing when nothing was needed)."""
        status = self.status()
        roomy = status.db_size < self.quota_bytes / 2 and not status.full
        self.wait_s = self.check_every_s * (ROOMY_FACTOR if roomy else 1)
        if status.full:
            alarms = self.store.request(
                "maintenance/alarm", {"action": "GET", "memberID": 0, "alarm": "NONE"}
            ).get("alarms", [])
            full = [a for a in alarms if a.get("alarm") == NOSPACE]
            if full:
                return [self._free_space(full)]
        wasted = status.db_size - status.db_in_use
        if self.clock() - self.last_defrag >= self.defrag_every_s or wasted > self.quota_bytes / 4:
            return [self._defragment(status.db_size)]
        return []

    def _free_space(self, alarms: list[dict[str, Any]]) -> str:
        before = self.status()
        try:
            self.store.request("kv/compaction", {"revision": before.revision, "physical": True})
        except StoreError as e:  # compacted already (by etcd itself, or a pass before)
            if "compacted" not in str(e):
                raise
        self._defragment(before.db_size)
        for alarm in alarms:
            self.store.request(
                "maintenance/alarm",
                {"action": "DEACTIVATE", "memberID": alarm.get("memberID", 0), "alarm": NOSPACE},
            )
        after = self.status()
        self.freed.append((before.db_size, after.db_size))
        message = (
            f"etcd's database reached its quota ({_mb(self.quota_bytes)}, NOSPACE alarm): "
            f"compacted to revision {before.revision}, defragmented "
            f"({_mb(before.db_size)} -> {_mb(after.db_size)}), alarm disarmed; "
            f"writes go on"
        )
        log.warning("%s", message)
        now = time.time()
        self.store.put(keys.event(now, SOURCE), Event(now, EventKind.WARNING, message).to_dict())
        return message

    def _defragment(self, size_before: int) -> str:
        self.store.request("maintenance/defragment", {})
        self.last_defrag = self.clock()
        self.defrags += 1
        message = f"etcd defragmented (was {_mb(size_before)})"
        log.info("%s", message)
        return message

    # -- the thread ---------------------------------------------------------------------------
    def start(self) -> EtcdUpkeep:
        self._thread = threading.Thread(target=self._loop, name="etcd-upkeep", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _loop(self) -> None:
        while not self._stopping.wait(self.wait_s):
            try:
                self.check()
            except StoreError as e:  # etcd down or stalled: the launcher sees it too
                log.debug("etcd upkeep skipped a pass: %s", e)


def _mb(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"
