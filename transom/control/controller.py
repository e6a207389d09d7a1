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
from urllib.parse import urlparse

from transom.checkpoint.catalog import discard_poisoned, newest_restorable
from transom.config import JobSpec
from transom.control.policy import decide, on_anomaly, slow_outliers
from transom.common.states import JobState
from transom.monitor import detectors
from transom.monitor.exporter import MonitorExporter
from transom.store import Store, StoreError
from transom.utils.net import host_address

log = logging.getLogger("transom.controller")

TICK_S = 0.2
LEADER_TTL_S = 3
# After the first failure report, wait this long for the reports of the other nodes.
SETTLE_S = 0.5
# A generation whose members have not all started workers by then is an incident.
WARMUP_TIMEOUT_S = 120.0
SPEC_WAIT_S = 120.0
# How long to wait for a node's pre-flight result before starting without comparing it.
PREFLIGHT_WAIT_S = 30.0
# A member whose monitor summary is older than this (while its agent lives) has a telemetry gap.
SUMMARY_GAP_S = 5.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# After the first NaN report, wait this long for the other nodes' (the first bad step may be elsewhere).
NUMERICS_SETTLE_S = 0.5


def natural_key(name: str) -> list:
    """node2 < node10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def new_job_record(now: float) -> dict:
    return {
        "state": JobState.PENDING.value,
        "generation": 0,
        "members": [],
        "evicted": {},
        "restarts_used": 0,
        "failures": {},
        "last_signature": None,
        "incident": None,
        "incident_open": False,
        "reason": "waiting for nodes",
        "since": now,
        "updated": now,
        "handled_anomalies": [],
        "numerics_steps": [],
        "hang_steps": [],
        "rollback_before": None,
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
        self.exporter = MonitorExporter()
        self._stragglers = detectors.StragglerTracker()
        self._monitored_generation = 0
        self._warned: set[tuple[str, tuple]] = set()

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
        if self.exporter.port is None and self.spec.metrics_port >= 0:
            port = self.exporter.serve(self.spec.metrics_port)
            if port is not None:
                host = (
                    "127.0.0.1" if urlparse(self.store.url).hostname in LOOPBACK else host_address()
                )
                self.store.put(
                    "exporter",
                    {"url": f"http://{host}:{port}/metrics", "controller": self.candidate_id},
                )
        self._event(
            "leader",
            f"controller {self.candidate_id} leads the job "
            f"(state {self.job['state']}, generation {self.job['generation']})",
        )
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
        self._pending_events.append(
            {
                "time": time.time(),
                "kind": kind,
                "message": message,
                "generation": self.job["generation"] if self.job else 0,
                "controller": self.candidate_id,
                **fields,
            }
        )

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
            "generation": j["generation"],
            "members": j["members"],
            "evicted": j["evicted"],
            "restart_count": j["restarts_used"],
            "job_state": j["state"],
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
            self.exporter.stop()
            if self.leading.is_set():
                self.leading.clear()
                try:
                    self.store.revoke(self.lease)
                except StoreError:
                    pass

    def _step(self) -> None:
        nodes = self.store.get_prefix("nodes/")
        statuses = self.store.get_prefix("status/")
        summaries = {
            n: s for n, s in self.store.get_prefix("monitor/").items() if n in self.job["members"]
        }
        self.exporter.update(self.job, summaries)
        state = JobState(self.job["state"])
        now = time.time()
        if state is JobState.PENDING:
            self._pending(nodes, now)
        elif state in (JobState.WARMUP, JobState.RUNNING):
            self._watch_generation(nodes, statuses, now)
            if self.job["state"] == JobState.RUNNING.value:
                self._watch_monitor(nodes, statuses, summaries, now)
        elif state is JobState.RECOVERING:
            self._recover(nodes, statuses, now)

    # -- states ---------------------------------------------------------------------------------
    def _healthy_nodes(self, nodes: dict) -> list[str]:
        return sorted((n for n in nodes if n not in self.job["evicted"]), key=natural_key)

    def _pending(self, nodes: dict, now: float) -> None:
        spec = self.spec
        waited = now - self.job["since"]
        checked = self.store.get_prefix("preflight/")
        if any(n not in checked for n in self._healthy_nodes(nodes)) and waited < PREFLIGHT_WAIT_S:
            return  # WARMUP of the job: every node's pre-flight result first
        if self._exclude_outliers(nodes, checked, now):
            self._commit()
        healthy = self._healthy_nodes(nodes)
        if len(healthy) >= spec.nnodes_max + spec.spares or (
            len(healthy) >= spec.nnodes_min and waited >= spec.join_timeout_s
        ):
            self._start_generation(healthy[: spec.nnodes_max], "start")

    def _exclude_outliers(
        self, nodes: dict, checked: dict, now: float, keep: list[str] = ()
    ) -> bool:
        """Evict nodes (but not those in `keep`) that failed pre-flight or are far below their peers."""
        j = self.job
        results = {n: r for n, r in checked.items() if n in nodes and n not in j["evicted"]}
        excluded = {
            n: "pre-flight check failed: " + "; ".join(r.get("problems", []))
            for n, r in results.items()
            if not r.get("passed", True)
        }
        excluded.update(
            {n: reason for n, reason in slow_outliers(results).items() if n not in excluded}
        )
        excluded = {n: reason for n, reason in excluded.items() if n not in keep}
        for node, reason in excluded.items():
            j["evicted"][node] = {"reason": reason, "time": now, "generation": j["generation"]}
            self._event(
                "evict",
                f"{node} excluded before training: {reason}",
                node=node,
                preflight=results[node],
            )
        return bool(excluded)

    def _start_generation(self, members: list[str], why: str, lost: list[str] = ()) -> None:
        j = self.job
        # The step every worker of the new generation resumes from (None: start fresh).
        j["restore_step"] = newest_restorable(
            self.store,
            len(members) * self.spec.nproc_per_node,
            before=j.get("rollback_before"),
            lost=[*lost, *j["evicted"]],
        )
        j["generation"] += 1
        j["members"] = members
        self._set_state(JobState.WARMUP, f"generation {j['generation']} starting")
        j["generation_started"] = time.time()
        j["handled_anomalies"] = []
        spares = [
            n for n in self._healthy_nodes(self.store.get_prefix("nodes/")) if n not in members
        ]
        restore = "fresh" if j["restore_step"] is None else f"from step {j['restore_step']}"
        self._event(
            "generation",
            f"generation {j['generation']} ({why}): members {', '.join(members)}; "
            f"spares {', '.join(spares) or 'none'}; resuming {restore}",
            members=members,
            spares=spares,
            restore_step=j["restore_step"],
        )
        self._commit(self._plan())

    def _reports(self, statuses: dict, state: str) -> dict[str, dict]:
        g = self.job["generation"]
        return {
            m: statuses[m]
            for m in self.job["members"]
            if m in statuses
            and statuses[m].get("generation") == g
            and statuses[m].get("state") == state
        }

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
            what = (
                [f"{m} lost" for m in lost]
                + [f"{m} reported a failure" for m in failed]
                + [f"{m} did not start workers within {WARMUP_TIMEOUT_S:.0f} s" for m in stuck]
            )
            j["incident"] = {"since": now, "generation": j["generation"], "stuck": stuck}
            self._set_state(JobState.RECOVERING, "; ".join(what))
            self._event("incident", "; ".join(what), lost=lost, failed=sorted(failed))
            self._commit(self._plan())
            return
        if len(self._reports(statuses, "succeeded")) == len(members):
            self._finish(
                JobState.SUCCEEDED,
                f"all {len(members)} nodes finished generation {j['generation']}",
            )
            return
        if j["state"] == JobState.WARMUP.value:
            started = self._reports(statuses, "running") | self._reports(statuses, "succeeded")
            if len(started) == len(members):
                j["incident_open"] = False
                if j.get("rollback_before") is not None:
                    # The workers that went bad are stopped now: forget their checkpoints from the bad
                    # step on, and let later restarts restore the newest checkpoint again.
                    discard_poisoned(self.store, j["rollback_before"], j["generation_started"])
                    j["rollback_before"] = None
                self._set_state(JobState.RUNNING, f"generation {j['generation']} running")
                self._event(
                    "running",
                    f"generation {j['generation']}: workers running on all {len(members)} nodes",
                )
                self._commit(self._plan())

    def _recover(self, nodes: dict, statuses: dict, now: float) -> None:
        j, spec = self.job, self.spec
        incident = j["incident"]
        members = j["members"]
        lost = [m for m in members if m not in nodes]
        failed = self._reports(statuses, "failed")
        silent = [m for m in members if m not in lost and m not in failed]
        own_fault = any(
            not f.get("peer_error") for r in failed.values() for f in r.get("failures", [])
        )
        elapsed = now - incident["since"]
        ready = (
            not silent
            or (elapsed >= SETTLE_S and (own_fault or lost or incident.get("stuck")))
            or elapsed >= spec.node_ttl_s + 1.0
        )
        if not ready:
            return
        d = decide(
            members, lost, failed, j["failures"], j["last_signature"], spec.evict_window_s, now
        )
        for node in incident.get("stuck", []):
            d.evict.setdefault(node, f"did not start workers within {WARMUP_TIMEOUT_S:.0f} s")
        self._event(
            "diagnosis",
            f"generation {j['generation']}: {d.summary}; blamed: {', '.join(d.blamed) or 'nobody'}",
            blamed=d.blamed,
            detection=incident["since"],
        )
        j["last_signature"] = d.signature
        if d.fail:
            self._finish(JobState.FAILED, d.fail)
            return
        self._restart(nodes, d.evict, d.summary, now)

    def _restart(self, nodes: dict, evict: dict[str, str], summary: str, now: float) -> None:
        """Spend a restart (once per incident), evict, take spares, and start the next generation."""
        j, spec = self.job, self.spec
        members = j["members"]
        if not j["incident_open"]:
            j["restarts_used"] += 1
            if j["restarts_used"] > spec.max_restarts:
                self._finish(
                    JobState.FAILED,
                    f"restart budget spent: {spec.max_restarts} restarts allowed "
                    f"(--max-restarts), another incident: {summary}",
                )
                return
        for node, reason in evict.items():
            j["evicted"][node] = {"reason": reason, "time": now, "generation": j["generation"]}
            self._event("evict", f"{node} evicted: {reason}", node=node)
        survivors = [m for m in members if m not in evict]
        self._exclude_outliers(nodes, self.store.get_prefix("preflight/"), now, keep=survivors)
        spares = [n for n in self._healthy_nodes(nodes) if n not in survivors]
        while len(survivors) < spec.nnodes_max and spares:
            spare = spares.pop(0)
            survivors.append(spare)
            self._event("spare", f"spare {spare} joins the job", node=spare)
        if len(survivors) < spec.nnodes_min:
            self._finish(
                JobState.FAILED,
                f"not enough nodes: {len(survivors)} healthy, at least "
                f"{spec.nnodes_min} needed (--nnodes) and no spare left",
            )
            return
        j["incident_open"] = True
        j["incident"] = None
        lost = [m for m in members if m not in nodes]  # their memory tier is gone
        self._start_generation(
            survivors, f"restart {j['restarts_used']} of {spec.max_restarts}", lost=lost
        )

    # -- the monitor ----------------------------------------------------------------------------
    def _watch_monitor(
        self, nodes: dict, statuses: dict, summaries: dict[str, dict], now: float
    ) -> None:
        """Cross-node detectors on the agents' summaries; every anomaly goes through the policy."""
        j = self.job
        if self._monitored_generation != j["generation"]:
            self._monitored_generation = j["generation"]
            self._stragglers = detectors.StragglerTracker()
            self._warned.clear()
        handled = set(j.get("handled_anomalies", []))
        found = [
            a
            for s in summaries.values()
            if s.get("generation") == j["generation"]
            for a in s.get("anomalies", [])
            if a["id"] not in handled
        ]
        found = self._earliest_numerics(found, now)
        views = detectors.rank_views(summaries, j["generation"], now)
        finishing = bool(
            self._reports(statuses, "succeeded")
        )  # ranks that are done make no progress
        for anomaly in (
            None if finishing else detectors.hang(views),
            self._stragglers.update(views),
        ):
            if anomaly is not None:
                found.append(self._controller_anomaly(anomaly, now))
        for node in j["members"]:
            s = summaries.get(node)
            if (
                node in nodes
                and s is not None
                and s.get("generation") == j["generation"]
                and now - s.get("t", now) > SUMMARY_GAP_S
            ):
                gap = detectors.Anomaly(
                    "telemetry_gap",
                    "warning",
                    f"{node}: no monitor summary for {now - s['t']:.1f} s while its agent is alive",
                    [node],
                )
                found.append(self._controller_anomaly(gap, now))
        for anomaly in found:
            if anomaly.get("repeat"):
                continue
            j.setdefault("handled_anomalies", []).append(anomaly["id"])
            self.exporter.count(anomaly)
            if self._act(anomaly, nodes, now):
                return
        if any(not a.get("repeat") for a in found):
            self._commit()

    def _earliest_numerics(self, found: list[dict], now: float) -> list[dict]:
        """Hold NaN reports for NUMERICS_SETTLE_S after the first, then keep the one of the earliest step.

        A NaN poisons every rank's weights within a step, so several nodes report one; the rollback
        must go before the first bad step, which the slowest reporter may hold.
        """
        nans = [a for a in found if a["type"] == "nan"]
        if not nans:
            return found
        if now - min(a.get("time", now) for a in nans) < NUMERICS_SETTLE_S:
            return [a for a in found if a["type"] != "nan"]
        first = min(
            nans, key=lambda a: (a.get("step") is None, a.get("step") or 0, a.get("time", 0))
        )
        self.job.setdefault("handled_anomalies", []).extend(a["id"] for a in nans if a is not first)
        return [a for a in found if a["type"] != "nan" or a is first]

    def _controller_anomaly(self, anomaly: detectors.Anomaly, now: float) -> dict:
        """An anomaly the controller found itself: give it an id and write its event."""
        a = anomaly.to_dict() | {
            "id": f"controller-{self.job['generation']}-{anomaly.type}-{now:.3f}",
            "generation": self.job["generation"],
        }
        key = (a["type"], tuple(a["nodes"]))
        if a["severity"] != "critical" and key in self._warned:
            return a | {"repeat": True}
        self._event(
            "anomaly",
            f"{a['type']}: {a['message']}",
            observed=a["time"],
            **{
                k: a[k]
                for k in (
                    "id",
                    "type",
                    "severity",
                    "nodes",
                    "ranks",
                    "evidence",
                    "step",
                    "hardware",
                )
            },
        )
        return a

    def _act(self, anomaly: dict, nodes: dict, now: float) -> bool:
        """Apply the policy's action for one anomaly; True when it ended the generation."""
        j, spec = self.job, self.spec
        free = len([n for n in self._healthy_nodes(nodes) if n not in j["members"]])
        action = on_anomaly(
            anomaly,
            j["members"],
            free,
            spec.nnodes_min,
            j.setdefault("numerics_steps", []),
            j.setdefault("hang_steps", []),
        )
        if action.kind == "none":
            return False
        key = (anomaly["type"], tuple(anomaly.get("nodes", [])))
        if action.kind == "warn":
            if key not in self._warned:
                self._warned.add(key)
                self._event(
                    "warning", action.reason, anomaly=anomaly["id"], nodes=anomaly.get("nodes", [])
                )
            return False
        self._event(
            "decision",
            f"{action.kind}: {action.reason}",
            action=action.kind,
            anomaly=anomaly["id"],
            anomaly_type=anomaly["type"],
            nodes=anomaly.get("nodes", []),
            detection=anomaly.get("time"),
        )
        if action.kind == "fail":
            self._finish(JobState.FAILED, action.reason)
            return True
        if anomaly["type"] == "hang" and anomaly.get("step") is not None:
            j["hang_steps"].append(anomaly["step"])
        if action.rollback_before is not None:
            j["numerics_steps"].append(action.rollback_before)
            previous = j.get("rollback_before")
            j["rollback_before"] = (
                min(previous, action.rollback_before) if previous else action.rollback_before
            )
            self._event(
                "rollback",
                f"next generation restores a checkpoint from before step {j['rollback_before']}",
                rollback_before=j["rollback_before"],
            )
        self._set_state(JobState.RECOVERING, action.reason)
        self._event("incident", action.reason, detection=anomaly.get("time"), anomaly=anomaly["id"])
        self._restart(nodes, action.evict, action.reason, now)
        return True

    def _finish(self, state: JobState, reason: str) -> None:
        self._set_state(state, reason)
        self._event(state.value.lower(), reason)
        self._commit(self._plan())
