"""Control-plane incidents: when vanished leases are etcd's fault, not the nodes'.

Part of one `decisions.decide` tick (pure: no etcd, no clock). A node's death is its lease's
expiry, but etcd that stalls (paused, overloaded, restarted) expires every lease at once: on
resume it may revoke them all in one go. That is one incident of the control plane, not N node
deaths, and it costs no restart and no eviction: the members are excused for a grace period in
which their agents, finding their lease gone while still members of the plan, register again
under the same node id without touching their workers (transom.control.agent).

A control-plane incident is either of:
- the controller's own store calls failed or stalled (`Snapshot.store_gap_s`, measured on its
  own clock by transom.control.observed) for long enough to have expired a lease
  (`lease_stall_s`), and that gap ended less than the grace period ago;
- at least two members, and at least half of them, vanished in the same tick;
- members already missing when this controller took the lead from another (its first
  snapshot as leader, `Snapshot.since_takeover_s`): a standby probes etcd rarely (it waits on a
  watch) so it did not see the stall that expired the previous leader's lease, and etcd revoked
  the members' expired leases with it, before the standby could take over. A node that really
  died as the leader did is found a grace period later: a delay, never a restart for nothing.
The grace period is the node TTL + REREGISTER_MARGIN_S: an agent checks its lease every
TTL/REFRESHES_PER_TTL and registers again on its next tick, so TTL covers it with margin to
spare. A member still missing when it ends is lost (evicted as usual). A single node cut off
while etcd answers the controller is never excused: no gap, and one lease alone is not "many
at once". (That node's own agent fences itself: transom.control.fence.)

`lift_evictions`: an evicted node whose agent started again (a new incarnation: a Kubernetes pod
restarted under the same name) rejoins as a spare.
"""

from __future__ import annotations

from transom.common.names import listing
from transom.common.records import EventKind
from transom.control.contact import PROBE_S
from transom.control.observed import MIN_GAP_S
from transom.control.tick import Tick
from transom.job_spec import JobSpec
from transom.store.etcd_client import REFRESHES_PER_TTL

REREGISTER_MARGIN_S = 2.0


def grace_s(spec: JobSpec) -> float:
    """How long members whose leases vanished in a control-plane incident may take to return."""
    return spec.node_ttl_s + REREGISTER_MARGIN_S


def lease_stall_s(spec: JobSpec) -> float:
    """The shortest gap the controller saw that may have expired a node's lease. A lease,
    renewed every TTL/REFRESHES_PER_TTL, expires only in a stall longer than the TTL less one
    renewal period (half of it), which the controller's probe (every PROBE_S) sees shortened by
    at most PROBE_S; a quarter of the TTL less is margin. Shorter gaps (a busy etcd or
    controller answering late: a 1.4 s one was seen at 512 nodes on 2 cores, with 20 s leases)
    are no incident: a lease lost then is a node's own, not etcd's. Never below MIN_GAP_S, the
    shortest gap observed at all (the default 8 s TTL and shorter keep the 1 s rule)."""
    stall_s = spec.node_ttl_s * (1 - 1 / REFRESHES_PER_TTL)
    return max(MIN_GAP_S, stall_s - spec.node_ttl_s / 4 - PROBE_S)


def excused_lost(tick: Tick, lost: list[str]) -> list[str]:
    """`lost` (members without a lease), or none of them during a control-plane incident."""
    memory, snap, now, members = tick.decision.memory, tick.snap, tick.now, tick.job.members
    newly = [m for m in lost if m not in memory.lost_before]
    memory.lost_before = set(lost)
    grace = grace_s(tick.spec)
    until, reason = None, ""
    stalled = snap.store_gap_s >= lease_stall_s(tick.spec)
    if stalled and snap.since_store_gap_s is not None and snap.since_store_gap_s < grace:
        until = now - snap.since_store_gap_s + grace
        reason = f"etcd did not answer the controller for {snap.store_gap_s:.1f} s"
    if len(newly) >= 2 and 2 * len(newly) >= len(members):
        until = max(until or now, now + grace)
        reason = f"{len(newly)} of {len(members)} members' leases vanished at once"
    taken = snap.since_takeover_s
    if taken is not None and newly:
        until = max(until or now, now - taken + grace)
        reason = reason or f"this controller took the lead {taken:.1f} s ago"
    in_grace = memory.grace_until is not None and now < memory.grace_until
    if until is not None and until > now and lost and not in_grace:
        memory.grace_until, memory.grace_reason = until, reason
        tick.event(
            EventKind.WARNING,
            f"control-plane incident ({reason}): waiting up to {until - now:.1f} s for "
            f"{listing(lost)} to register again; no restart, no eviction",
            nodes=list(lost),
        )
        return []
    if in_grace:
        if lost:
            return []
        tick.event(
            EventKind.WARNING,
            f"control-plane incident over ({memory.grace_reason}): every member registered "
            f"again, workers kept",
        )
        memory.grace_until = None
        return []
    memory.grace_until = None
    return lost


def lift_evictions(tick: Tick) -> None:
    """Take back, as spares, evicted nodes whose agent started again (a new incarnation)."""
    j = tick.job
    pending = j.next_generation.members if j.next_generation else []
    for node, registration in tick.snap.nodes.items():
        eviction = j.evicted.get(node)
        if (
            eviction is None
            or registration is None
            or not eviction.incarnation
            or not registration.incarnation
            or registration.incarnation == eviction.incarnation
            or node in j.members
            or node in pending
        ):
            continue
        del j.evicted[node]
        tick.event(
            EventKind.SPARE,
            f"{node} rejoins as a spare: its agent started again after its eviction "
            f"({eviction.reason})",
            node=node,
        )
        tick.write_plan()
