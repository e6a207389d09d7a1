"""Which nodes of a multi-machine job run a controller candidate: the first N live nodes.

A controller candidate on every machine of a thousand-node job is a thousand processes that
stand by, each reading etcd and holding a watch, to survive what three survive as well. So a
job has at most N candidates (`transom run --controllers N`, DEFAULT_CANDIDATES): those of the
first N live nodes in registration order (the registration's `since`, then the node id in
`names.natural_key` order: node2 before node10), where a node is live while its agent's
registration (`nodes/<node>`, under the agent's lease) is in etcd. A node that registers later
never displaces one that runs a candidate (unless its agent's clock is behind by more than the
time between the two), so a thousand nodes registering in any order start N candidates, not a
candidate on each node that was among the first N for a moment. Every
launcher follows the registrations through a watch and runs a candidate for each of its own
nodes among them; the others only watch. When a candidate's node dies (its machine is lost, its
agent exits or is evicted and leaves) the registration expires with its lease and the next
live node in that order is promoted at once, so there are again N while N nodes remain.

A node that drops out of the first N while it still runs a candidate (every lease was revoked at
once and the agents registered again in another order, or its agent registered again) keeps its
candidate for `demote_after_s` more (DEMOTE_AFTER_S, or twice the controller's grace for such an
incident if longer: transom.control.grace): a few seconds with N+1 candidates cost less than a
controller stopped in the middle of one.

Nothing read is trusted: a registration whose `since` is not a finite number is still a live
node, ordered after the others, and a key that is not a valid node id is no node of this job.
This module must never start or stop processes (the launcher does) nor write to etcd; an etcd it
cannot read raises StoreError to its caller, who keeps the candidates it runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from transom.common import keys
from transom.common.names import natural_key, valid_id
from transom.control.grace import grace_s
from transom.job_spec import JobSpec
from transom.store import Store
from transom.store.prefix_mirror import PrefixMirror

DEFAULT_CANDIDATES = 3  # a job's controller candidates unless --controllers says otherwise
DEMOTE_AFTER_S = 15.0  # at least; > the controller's grace after every lease was revoked


def demote_after_s(spec: JobSpec) -> float:
    """How long a node out of the first N keeps its candidate."""
    return max(DEMOTE_AFTER_S, 2 * grace_s(spec))


def first_live(registrations: Mapping[str, object], n: int) -> list[str]:
    """The first `n` node ids of `registrations` (node id -> its registration, as read under
    `nodes/`) in registration order; names that are not valid node ids are ignored."""
    nodes = [name for name in registrations if isinstance(name, str) and valid_id(name)]

    def order(node: str) -> tuple[float, tuple[int | str, ...]]:
        value = registrations[node]
        since = value.get("since") if isinstance(value, dict) else None
        if isinstance(since, bool) or not isinstance(since, int | float):
            return math.inf, natural_key(node)
        return (since if math.isfinite(since) else math.inf), natural_key(node)

    return sorted(nodes, key=order)[: max(0, n)]


class Candidacy:
    """For the nodes of this machine, which ones run a controller candidate now."""

    def __init__(self, store: Store, n: int, demote_after_s: float = DEMOTE_AFTER_S) -> None:
        self.n = n
        self.demote_after_s = demote_after_s
        self.registrations = PrefixMirror(store, keys.NODES)
        self._out_since: dict[str, float] = {}  # a running candidate's node out of the first n

    def stop(self) -> None:
        self.registrations.stop()

    def keep(self, local: Sequence[str], running: Iterable[str], now: float) -> set[str]:
        """Of this machine's nodes `local` (those that run a candidate: `running`), those that
        run one from now on (StoreError if the registrations cannot be read)."""
        self.registrations.start_once(now)
        self.registrations.refresh(now)
        chosen = set(first_live(self.registrations.values, self.n))
        keep = {node for node in local if node in chosen}
        out_since = {}
        for node in set(running) - keep:
            out_since[node] = self._out_since.get(node, now)
            if now - out_since[node] < self.demote_after_s:
                keep.add(node)
        self._out_since = out_since
        return keep
