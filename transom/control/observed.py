"""What a controller observed on its own monotonic clock: summary ages and its gaps to etcd.

Ages and timeouts are never the difference of two machines' wall clocks: a monitor summary's
age is the time since this controller saw it change (an agent's `t` is only compared with the
same agent's previous `t`), so an agent whose clock is 30 s off looks exactly like one whose
clock is right. A gap is a stretch in which this controller's store calls failed or stalled
(etcd paused, restarted, unreachable): its length and how long ago it ended go into the
snapshot, so `decide` can tell a control-plane incident from node deaths; and since nothing
could be seen during a gap, every summary counts as seen at its end (no false hang or
telemetry gap because etcd was paused).

Pure bookkeeping: the caller passes the monotonic time; this module never reads a clock or etcd.
"""

from __future__ import annotations

from transom.common.records import MonitorSummary

# A stretch without a successful store call at least this long is a gap. Shorter than any
# lease's renewal slack matters: a node's lease (TTL >= 2 s, renewed twice a TTL,
# store.etcd_client.REFRESHES_PER_TTL) can only expire in a stall longer than half its TTL, so
# half the shortest TTL catches every such stall.
MIN_GAP_S = 1.0


class Observed:
    """One controller's observations, kept across ticks (and across leading and standing by)."""

    def __init__(self) -> None:
        self.last_ok: float | None = None  # when the last store call succeeded
        self.gap_s = 0.0  # length of the newest gap
        self.gap_ended: float | None = None  # when it ended (None: never a gap)
        self._seen: dict[str, tuple[float, float]] = {}  # node -> (summary's t, seen change)

    def reached(self, now: float, started: float, idle_s: float = 0.0) -> None:
        """A round of store calls that began at `started` succeeded at `now`; `idle_s`: how
        long the caller chose to wait since its previous success (no call outstanding, so no
        part of a gap: a prober that calls every 0.5 s is not in a 0.5 s gap)."""
        gap = now - (self.last_ok if self.last_ok is not None else started) - idle_s
        if gap >= MIN_GAP_S:
            self.gap_s, self.gap_ended = gap, now
            # Nothing could be seen in the gap: every summary is as fresh as its end.
            self._seen = {n: (t, now) for n, (t, _) in self._seen.items()}
        self.last_ok = now

    def since_gap(self, now: float) -> float | None:
        return None if self.gap_ended is None else now - self.gap_ended

    def summary_ages(
        self,
        summaries: dict[str, MonitorSummary],
        now: float,
        arrived: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """Seconds since this controller saw each node's summary change; `arrived`: when each
        summary reached it (a watch delivered it), if before `now` (never before a gap's end)."""
        ages = {}
        for node, s in summaries.items():
            seen = self._seen.get(node)
            if seen is None or seen[0] != s.t:
                at = now if arrived is None else arrived.get(node, now)
                if self.gap_ended is not None:
                    at = max(at, self.gap_ended)
                seen = (s.t, min(at, now))
                self._seen[node] = seen
            ages[node] = max(0.0, now - seen[1])  # a gap may end as the tick reads
        return ages
