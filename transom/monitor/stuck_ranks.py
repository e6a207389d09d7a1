"""The node agent's looks at its ranks while none of them finishes a step.

Once every rank of the node finished a first step and none finished one for
detectors.suspect_after_s (as the controller's hang rule computes it from these ranks' step
times), and again every such time while none does, the node's monitor (transom.monitor.node)
asks for a collection (transom.monitor.stacks): where each rank is ("stopped", "in all_reduce at
train.py:57"), which the controller's hang event names, and which ranks are at work outside a
step (transom.monitor.busy). A rank found at work counts as in busy.BUSY_PHASE until the next
look's verdict could be in; the hang rule then waits for it as for a save.

The methods taking `ranks` run under the node monitor's lock; `look` runs outside it (it starts
a thread). What it must never do: signal ranks while a rank is in a phase its worker reported
(a save, an evaluation: their own timeout covers them), or keep a collection of an older step or
generation: the node has moved on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path

from transom.common import files
from transom.common.records import RankSummary
from transom.monitor import busy, detectors, stacks
from transom.monitor.rank_timing import RankTrack

# A rank found at work stays busy until the next look's verdict could be in: that look's period
# and this (the look itself, 0.25 s and its dumps, and a late agent tick).
BUSY_HOLD_MARGIN_S = 2.0
# While a collection is still under way, the next check comes this much later.
RETRY_S = 0.1

Request = tuple[tuple[int, int, int], dict[int, tuple[int, Path]]]


class StuckRanks:
    """One node's looks at its stuck ranks, and what the newest one found."""

    def __init__(
        self, hang_floor_s: float, script: str, done: Callable[[], None] | None = None
    ) -> None:
        """`hang_floor_s` and `script`: the job's hang floor and script; `done` is called (from
        the collector's thread) when a collection's results are in."""
        self.hang_floor_s = hang_floor_s
        self.script = script
        self.stacks_dir: Path | None = None  # where the workers' dump handler writes (None: none)
        self.collector = stacks.StackCollector(done=done)
        self.check_at: float | None = None  # when the next look is due if no rank progresses
        # (generation, newest step, look number) of the newest collection, and when it was asked
        self.key: tuple[int, int, int] | None = None
        self.looked_at = -math.inf
        self.taken: stacks.Collection | None = None  # the collection whose busy ranks are marked
        self.hold_s = 0.0  # how long a rank found at work counts as busy

    def reset(self) -> None:
        """A new generation: nothing collected."""
        self.key, self.taken, self.looked_at, self.check_at = None, None, -math.inf, None
        self.collector.reset()

    def due(
        self, ranks: Mapping[int, RankTrack], pids: dict[int, int], generation: int, now: float
    ) -> Request | None:
        """The look to take now (its key and its ranks' pids and stacks files), if one is due;
        sets `check_at` for the next."""
        self.check_at = None
        self.take_busy(ranks, generation, now)
        tracks = [ranks.get(rank) for rank in pids]
        if (
            self.stacks_dir is None
            or not pids
            or any(r is None or r.step is None or r.step_at is None for r in tracks)
        ):
            return None
        known = [r for r in tracks if r is not None]
        step_times = [statistics.median(r.durations) for r in known if r.durations]
        timeout = detectors.hang_timeout_s(self.hang_floor_s, step_times)
        quiet = min(now - r.step_at for r in known if r.step_at is not None)
        stuck = (generation, max(r.step for r in known if r.step is not None))
        suspect = detectors.suspect_after_s(timeout, step_times)
        if quiet < suspect:
            self.check_at = now + suspect - quiet
            return None
        if any(r.phase for r in known):
            return None
        same = self.key is not None and self.key[:2] == stuck
        if same and now < self.looked_at + suspect:
            self.check_at = self.looked_at + suspect  # look again then, while no rank steps
            return None
        if self.collector.collecting():
            self.check_at = now + RETRY_S
            return None
        self.key = (*stuck, self.key[2] + 1 if same and self.key is not None else 0)
        self.looked_at, self.hold_s = now, suspect + BUSY_HOLD_MARGIN_S
        self.check_at = now + suspect
        where = self.stacks_dir
        return self.key, {
            rank: (pid, where / files.stacks_name(rank)) for rank, pid in pids.items()
        }

    def look(self, request: Request) -> None:
        """Start the collection `due` asked for."""
        key, targets = request
        self.collector.request(key, targets, self.script)

    def collection(
        self, ranks: Mapping[int, RankTrack], generation: int
    ) -> stacks.Collection | None:
        """The newest collection, while the node is still at the step it was taken at."""
        if self.key is None:
            return None
        newest = max((r.step for r in ranks.values() if r.step is not None), default=None)
        return self.collector.results(self.key) if (generation, newest) == self.key[:2] else None

    def where(self, ranks: Mapping[int, RankTrack], generation: int) -> dict[int, str]:
        """The collected stacks' lines, while the node is still at the step they were taken at."""
        found = self.collection(ranks, generation)
        return dict(found.where) if found is not None else {}

    def take_busy(self, ranks: Mapping[int, RankTrack], generation: int, now: float) -> None:
        """Mark the ranks the newest collection found at work (once per collection): they count
        as in busy.BUSY_PHASE for the next look's period and BUSY_HOLD_MARGIN_S more."""
        found = self.collection(ranks, generation)
        if found is None or found is self.taken:
            return
        self.taken = found
        for rank in found.busy:
            r = ranks.get(rank)
            if r is not None:
                r.busy_until = now + self.hold_s

    def news(
        self,
        ranks: Mapping[int, RankTrack],
        generation: int,
        shown: Mapping[str, RankSummary],
        now: float,
    ) -> bool:
        """Whether the summary `shown` last is out of date: a rank's place changed, or a rank
        was found at work, or is no longer."""
        places = {r: v.where for r, v in shown.items()}
        if any(w != places.get(str(r)) for r, w in self.where(ranks, generation).items()):
            return True
        self.take_busy(ranks, generation, now)
        phases = {r: v.phase for r, v in shown.items()}
        return any(
            (now < r.busy_until) != (phases.get(str(rank)) == busy.BUSY_PHASE)
            for rank, r in ranks.items()
            if r.phase is None
        )
