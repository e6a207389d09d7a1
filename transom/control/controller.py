"""The controller: drives a job's state machine (see `JobState`) from the state kept in etcd.

Several candidates may run; one wins leadership by creating the `leader` key under its lease,
and every write it makes is fenced on still holding that key. All decisions and the state
they need (generation, members, evictions, failure history, restart budget) live in the
`job` record, so a candidate that takes over after the leader died continues where it
stopped. Each decision is also an event with a reason in `events/`.

The controller never touches processes: it writes the `plan` (generation, members, evicted
nodes) and the agents act on it.
"""

from __future__ import annotations

import logging
import re
import threading
import time

from transom.checkpoint.catalog import newest_restorable
from transom.config import JobSpec
from transom.control.policy import decide
from transom.control.states import JobState
from transom.store import Store, StoreError

log = logging.getLogger("transom.controller")

TICK_S = 0.2
LEADER_TTL_S = 3
# After the first failure report, wait this long for the reports of the other nodes.
SETTLE_S = 0.5
# A generation whose members have not all started workers by then is an incident.
WARMUP_TIMEOUT_S = 120.0
SPEC_WAIT_S = 120.0


def natural_key(name: str) -> list:
    """node2 < node10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def new_job_record(now: float) -> dict:
    return {
        "state": JobState.PENDING.value, "generation": 0, "members": [], "evicted": {},
        "restarts_used": 0, "failures": {}, "last_signature": None, "incident": None,
        "incident_open": False, "reason": "waiting for nodes", "since": now, "updated": now,
    }


class Controller:
    """One controller candidate for one job.

    `candidate_id` must be unique to this process (never reused by a restarted candidate): the
    leader's writes are fenced by comparing it with the value of the `leader` key.
    """

    def __init__(self, store: Store, candidate_id: str):
        self.store = store
        self.candidate_id = candidate_id
        self.spec: JobSpec | None = None
        self.job: dict | None = None
        self.lease = None
        self.leading = threading.Event()
        self.stopping = threading.Event()
        self._pending_events: list[dict] = []

    # -- leadership ---------------------------------------------------------------------------
    def _try_lead(self) -> bool:
        lease = self.store.lease(LEADER_TTL_S)
        if not self.store.create("leader", self.candidate_id, lease=lease):
            self.store.revoke(lease)
            return False
        self.lease = lease
        self.leading.set()
        threading.Thread(target=self._keep_leading, name="leader-keepalive", daemon=True).start()
        self.job = self.store.get("job") or new_job_record(time.time())
        self._event("leader", f"controller {self.candidate_id} leads the job "
                              f"(state {self.job['state']}, generation {self.job['generation']})")
        self._commit()
        return True

    def _keep_leading(self) -> None:
        while self.leading.is_set() and not self.stopping.wait(LEADER_TTL_S / 4):
            try:
                if not self.store.refresh(self.lease):
                    log.warning("leadership lease expired")
                    self.leading.clear()
            except StoreError:
                pass

    # -- writes ---------------------------------------------------------------------------------
    def _event(self, kind: str, message: str, **fields) -> None:
        self._pending_events.append({
            "time": time.time(), "kind": kind, "message": message,
            "generation": self.job["generation"] if self.job else 0,
            "controller": self.candidate_id, **fields,
        })

    def _commit(self, plan: dict | None = None) -> None:
        """Write the job record, the plan and new events in one transaction fenced on leadership."""
        self.job["updated"] = time.time()
        values = {"job": self.job}
        if plan is not None:
            values["plan"] = plan
        for e in self._pending_events:
            values[f"events/{int(e['time'] * 1e9):020d}-{self.candidate_id}"] = e
            log.info("%s: %s", e["kind"], e["message"])
        self._pending_events = []
        if not self.store.put_if_leader(self.candidate_id, values):
            log.warning("lost leadership; not writing")
            self.leading.clear()

    def _plan(self) -> dict:
        j = self.job
        return {
            "generation": j["generation"], "members": j["members"], "evicted": j["evicted"],
            "restart_count": j["restarts_used"], "job_state": j["state"],
            "restore_step": j.get("restore_step"),
        }

    def _set_state(self, state: JobState, reason: str) -> None:
        self.job["state"] = state.value
        self.job["reason"] = reason

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> int:
        """Lead or stand by until the job ends; 0 if it succeeded."""
        self.spec = JobSpec.from_dict(self.store.wait_for("spec", SPEC_WAIT_S))
        try:
            while not self.stopping.is_set():
                try:
                    if not self.leading.is_set():
                        job = self.store.get("job")
                        if job and JobState(job["state"]).terminal:
                            return 0 if job["state"] == JobState.SUCCEEDED.value else 1
                        if not self._try_lead():
                            time.sleep(TICK_S)
                            continue
                    self._step()
                    if JobState(self.job["state"]).terminal and self.leading.is_set():
                        return 0 if self.job["state"] == JobState.SUCCEEDED.value else 1
                except StoreError as e:
                    log.warning("store error: %s", e)
                    time.sleep(1.0)
                time.sleep(TICK_S)
            return 1
        finally:
            self.stopping.set()
            if self.leading.is_set():
                self.leading.clear()
                try:
                    self.store.revoke(self.lease)
                except StoreError:
                    pass

    def _step(self) -> None:
        nodes = self.store.get_prefix("nodes/")
        statuses = self.store.get_prefix("status/")
        state = JobState(self.job["state"])
        now = time.time()
        if state is JobState.PENDING:
            self._pending(nodes, now)
        elif state in (JobState.WARMUP, JobState.RUNNING):
            self._watch_generation(nodes, statuses, now)
        elif state is JobState.RECOVERING:
            self._recover(nodes, statuses, now)

    # -- states ---------------------------------------------------------------------------------
    def _healthy_nodes(self, nodes: dict) -> list[str]:
        return sorted((n for n in nodes if n not in self.job["evicted"]), key=natural_key)

    def _pending(self, nodes: dict, now: float) -> None:
        spec, healthy = self.spec, self._healthy_nodes(nodes)
        waited = now - self.job["since"]
        if len(healthy) >= spec.nnodes_max + spec.spares or (
                len(healthy) >= spec.nnodes_min and waited >= spec.join_timeout_s):
            self._start_generation(healthy[:spec.nnodes_max], "start")

    def _start_generation(self, members: list[str], why: str, lost: list[str] = ()) -> None:
        j = self.job
        # The step every worker of the new generation resumes from (None: start fresh).
        j["restore_step"] = newest_restorable(self.store, len(members) * self.spec.nproc_per_node,
                                              before=j.get("rollback_before"), lost=[*lost, *j["evicted"]])
        j["generation"] += 1
        j["members"] = members
        self._set_state(JobState.WARMUP, f"generation {j['generation']} starting")
        j["generation_started"] = time.time()
        spares = [n for n in self._healthy_nodes(self.store.get_prefix("nodes/")) if n not in members]
        restore = "fresh" if j["restore_step"] is None else f"from step {j['restore_step']}"
        self._event("generation", f"generation {j['generation']} ({why}): members {', '.join(members)}; "
                                  f"spares {', '.join(spares) or 'none'}; resuming {restore}",
                    members=members, spares=spares, restore_step=j["restore_step"])
        self._commit(self._plan())

    def _reports(self, statuses: dict, state: str) -> dict[str, dict]:
        g = self.job["generation"]
        return {m: statuses[m] for m in self.job["members"]
                if m in statuses and statuses[m].get("generation") == g and statuses[m].get("state") == state}

    def _watch_generation(self, nodes: dict, statuses: dict, now: float) -> None:
        j = self.job
        members = j["members"]
        lost = [m for m in members if m not in nodes]
        failed = self._reports(statuses, "failed")
        stuck = []
        if j["state"] == JobState.WARMUP.value and now - j["generation_started"] > WARMUP_TIMEOUT_S:
            running = self._reports(statuses, "running")
            stuck = [m for m in members if m not in running]
        if lost or failed or stuck:
            what = ([f"{m} lost" for m in lost] + [f"{m} reported a failure" for m in failed]
                    + [f"{m} did not start workers within {WARMUP_TIMEOUT_S:.0f} s" for m in stuck])
            j["incident"] = {"since": now, "generation": j["generation"], "stuck": stuck}
            self._set_state(JobState.RECOVERING, "; ".join(what))
            self._event("incident", "; ".join(what), lost=lost, failed=sorted(failed))
            self._commit(self._plan())
            return
        if len(self._reports(statuses, "succeeded")) == len(members):
            self._finish(JobState.SUCCEEDED, f"all {len(members)} nodes finished generation {j['generation']}")
            return
        if j["state"] == JobState.WARMUP.value:
            started = self._reports(statuses, "running") | self._reports(statuses, "succeeded")
            if len(started) == len(members):
                j["incident_open"] = False
                self._set_state(JobState.RUNNING, f"generation {j['generation']} running")
                self._event("running", f"generation {j['generation']}: workers running on all "
                                       f"{len(members)} nodes")
                self._commit(self._plan())

    def _recover(self, nodes: dict, statuses: dict, now: float) -> None:
        j, spec = self.job, self.spec
        incident = j["incident"]
        members = j["members"]
        lost = [m for m in members if m not in nodes]
        failed = self._reports(statuses, "failed")
        silent = [m for m in members if m not in lost and m not in failed]
        own_fault = any(not f.get("peer_error") for r in failed.values() for f in r.get("failures", []))
        elapsed = now - incident["since"]
        ready = (not silent or (elapsed >= SETTLE_S and (own_fault or lost or incident.get("stuck")))
                 or elapsed >= spec.node_ttl_s + 1.0)
        if not ready:
            return
        d = decide(members, lost, failed, j["failures"], j["last_signature"], spec.evict_window_s, now)
        for node in incident.get("stuck", []):
            d.evict.setdefault(node, f"did not start workers within {WARMUP_TIMEOUT_S:.0f} s")
        self._event("diagnosis", f"generation {j['generation']}: {d.summary}; blamed: "
                                 f"{', '.join(d.blamed) or 'nobody'}", blamed=d.blamed, detection=incident["since"])
        j["last_signature"] = d.signature
        if d.fail:
            self._finish(JobState.FAILED, d.fail)
            return
        if not j["incident_open"]:
            j["restarts_used"] += 1
            if j["restarts_used"] > spec.max_restarts:
                self._finish(JobState.FAILED, f"restart budget spent: {spec.max_restarts} restarts allowed "
                                              f"(--max-restarts), another incident: {d.summary}")
                return
        for node, reason in d.evict.items():
            j["evicted"][node] = {"reason": reason, "time": now, "generation": j["generation"]}
            self._event("evict", f"{node} evicted: {reason}", node=node)
        survivors = [m for m in members if m not in d.evict]
        spares = [n for n in self._healthy_nodes(nodes) if n not in survivors]
        while len(survivors) < spec.nnodes_max and spares:
            spare = spares.pop(0)
            survivors.append(spare)
            self._event("spare", f"spare {spare} joins the job", node=spare)
        if len(survivors) < spec.nnodes_min:
            self._finish(JobState.FAILED, f"not enough nodes: {len(survivors)} healthy, at least "
                                          f"{spec.nnodes_min} needed (--nnodes) and no spare left")
            return
        j["incident_open"] = True
        j["incident"] = None
        self._start_generation(survivors, f"restart {j['restarts_used']} of {spec.max_restarts}", lost=lost)

    def _finish(self, state: JobState, reason: str) -> None:
        self._set_state(state, reason)
        self._event(state.value.lower(), reason)
        self._commit(self._plan())
