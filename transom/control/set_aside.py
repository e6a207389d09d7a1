"""Members taken for dead before their lease expired: who, and what becomes of them.

Part of one `decisions.decide` tick (pure: no etcd, no clock). A node's death is its lease's
expiry, up to a node TTL (8 s by default) after the fact. Its peers know sooner: their workers
fail on it within a fraction of a second. So when every other member has reported its workers'
failure on a peer and a member's agent, which reports its own workers' exit as it happens, has
said nothing for SILENT_AGENT_S, that member is taken for dead (`take_for_dead`) and a spare
takes its place at once (decisions.recover, tick.restart). Only where a spare can: a job is never
shrunk on that guess.

The guess can be wrong (an agent slow to report, a member whose workers have not reached a
collective yet), so a member is set aside, not evicted: its memory tier is not relied on for
the restore, and `follow_up` evicts it once its lease does expire (so a scheduler drains it and
the launcher refills it, as for any lost node) or forgets it once it outlived a node TTL and
the grace to register again: it is alive, and a spare like any other.

It never evicts during a control-plane incident (transom.control.grace): leases vanish then
through etcd's fault, not the nodes'.
"""

from __future__ import annotations

from transom.control.grace import REREGISTER_MARGIN_S
from transom.control.policy import LEASE_EXPIRED
from transom.control.tick import Tick

# A member that has not reported this long after its peers lost their workers to one of them is
# taken for dead with its workers: a live agent reports its workers' exit as it happens (a
# pidfd wakes it: utils/exit_watch.py) in one etcd write, and workers that failed on a dead peer
# exit within 0.1 s of each other since the bootstrap skips the interpreter's teardown (1 s
# while agents found exits at their 0.2 s tick; 1-3 s before the fast exit). The demo's peers
# reported within 0.1 s of each other; a wrong guess costs little (above): 0.3 s, not 0.5 s.
SILENT_AGENT_S = 0.3


def take_for_dead(silent: list[str], elapsed_s: float) -> list[str]:
    """The members to set aside now: `silent` ones, once SILENT_AGENT_S passed since the
    incident began (the caller has checked that spares can take their places: `replaceable`)."""
    return list(silent) if elapsed_s >= SILENT_AGENT_S - 1e-9 else []  # due at since + 0.3


def replaceable(tick: Tick, silent: list[str]) -> bool:
    """Whether spares can take the places of every one of `silent`."""
    return bool(silent) and len(tick.spares(tick.job.members)) >= len(silent)


def follow_up(tick: Tick) -> None:
    """Evict set-aside nodes whose lease expired; forget those that outlived it (spares)."""
    j, memory = tick.job, tick.decision.memory
    if memory.grace_until is not None and tick.now < memory.grace_until:
        return
    for node, since in sorted(j.set_aside.items()):
        if node not in tick.snap.nodes:
            del j.set_aside[node]
            if node not in j.members and node not in j.evicted:
                tick.evict(node, LEASE_EXPIRED, f"{node} evicted: {LEASE_EXPIRED}", lost=[node])
                tick.write_plan()
        elif tick.now >= forgotten_at(tick, since):
            del j.set_aside[node]


def forgotten_at(tick: Tick, since: float) -> float:
    """When a node set aside at `since` that still holds its lease is alive after all: it
    outlived a node TTL and the grace to register again (then forgotten: a spare again)."""
    return since + tick.spec.node_ttl_s + REREGISTER_MARGIN_S


def resolved_by(tick: Tick) -> float | None:
    """When every set-aside node will have been evicted (its lease expired) or forgotten
    (`forgotten_at`) at the latest; None when none is set aside. A job whose members all
    finished waits for this before it ends, so a dead node is evicted (and a scheduler drains
    it) even when the job ended within its lease's TTL of the death; `follow_up` settles every
    such node by that moment."""
    if not tick.job.set_aside:
        return None
    return max(forgotten_at(tick, since) for since in tick.job.set_aside.values())
