"""The node agent: one per node; registers the node, follows the controller's plan, runs workers.

The agent registers its node in etcd under a lease it keeps alive (the node's death is the
lease's expiry), reads the plan every tick, and for each new generation stops the old workers
and, when the node is a member, runs its pre-flight checks (first time only) and starts the new
ones. It reports what its workers do to `status/<node>`; the controller decides, the agent
never restarts workers on its own. An agent cut off from etcd for longer than its lease stops
its workers itself (self-fencing), and an evicted agent stops and exits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from transom.config import JobSpec
from transom.control.ckpt_node import NodeCheckpointServer
from transom.control.preflight import preflight
from transom.control.progress import ProgressListener
from transom.control.workers import Assignment, WorkerGroup
from transom.store import Store, StoreError
from transom.utils.net import free_port

log = logging.getLogger("transom.agent")

TICK_S = 0.2
SPEC_WAIT_S = 120.0
PROGRESS_PUBLISH_S = 1.0
EXIT_EVICTED = 3


class NodeAgent:
    def __init__(self, store: Store, node_id: str, run_dir: Path, host: str = "127.0.0.1"):
        self.store = store
        self.node_id = node_id
        self.run_dir = Path(run_dir)
        self.host = host
        self.spec: JobSpec | None = None
        self.lease = None
        self.lease_lost = threading.Event()
        self.stopping = threading.Event()
        self.generation = 0
        self.group: WorkerGroup | None = None
        self.group_state = "idle"
        self.waiting_for_master: dict | None = None  # the plan whose master address we await
        self.preflight_done = False
        self.progress = ProgressListener()
        self.last_store_ok = time.monotonic()
        self._published_step: int | None = None
        self._published_at = 0.0
        self.ckpt: NodeCheckpointServer | None = None

    # -- registration -------------------------------------------------------------------------
    def _register(self) -> None:
        assert self.spec is not None
        self.lease = self.store.lease(self.spec.node_ttl_s)
        self.lease_lost.clear()
        self.store.put(f"nodes/{self.node_id}", {
            "node": self.node_id, "host": self.host, "pid": os.getpid(), "since": time.time(),
        }, lease=self.lease)
        self._report(self.group_state)

    def _keep_alive(self) -> None:
        assert self.spec is not None
        interval = self.spec.node_ttl_s / 4
        while not self.stopping.wait(interval):
            if self.lease is None or self.lease_lost.is_set():
                continue
            try:
                if not self.store.refresh(self.lease):
                    log.warning("node lease expired")
                    self.lease_lost.set()
            except StoreError:
                pass  # the main loop's self-fencing handles a long outage

    def _report(self, state: str, **extra) -> None:
        self.group_state = state
        value = {"node": self.node_id, "generation": self.generation, "state": state,
                 "time": time.time(), "step": self.progress.newest_step(), **extra}
        # Not leased: the last status of a dead node stays readable; liveness is `nodes/<node>`.
        self.store.put(f"status/{self.node_id}", value)
        self._published_step = value["step"]
        self._published_at = time.monotonic()

    # -- main loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Serve the job until it ends; the exit code says how it ended for this node."""
        self.spec = JobSpec.from_dict(self.store.wait_for("spec", SPEC_WAIT_S))
        self.ckpt = NodeCheckpointServer(self.spec, self.store, self.node_id, self.run_dir, self.host)
        self.ckpt.start()
        self._register()
        threading.Thread(target=self._keep_alive, name="lease-keepalive", daemon=True).start()
        log.info("node %s registered", self.node_id)
        try:
            while not self.stopping.is_set():
                outcome = self._tick()
                if outcome is not None:
                    return outcome
                time.sleep(TICK_S)
            return 0
        finally:
            self.stopping.set()
            self._stop_group()
            if self.ckpt is not None:
                self.ckpt.stop()
            self.progress.close()
            if self.lease is not None:
                try:
                    self.store.revoke(self.lease)
                except StoreError:
                    pass

    def _tick(self) -> int | None:
        assert self.spec is not None
        try:
            if self.lease_lost.is_set():
                self._stop_group()
                self._register()
            plan = self.store.get("plan")
            self.last_store_ok = time.monotonic()
            try:
                self.ckpt.ensure_running()
            except RuntimeError as e:  # workers fall back to peers and storage; retried next tick
                log.warning("%s", e)
        except StoreError as e:
            if self.group and time.monotonic() - self.last_store_ok > self.spec.node_ttl_s:
                log.warning("cut off from etcd for %.0f s (%s): stopping workers", self.spec.node_ttl_s, e)
                self._stop_group()
                self.group_state = "idle"
            return None
        if plan is None:
            return None
        if plan.get("job_state") in ("SUCCEEDED", "FAILED"):
            log.info("job ended: %s", plan["job_state"])
            return 0 if plan["job_state"] == "SUCCEEDED" else 1
        if self.node_id in plan.get("evicted", {}):
            log.warning("node evicted: %s", plan["evicted"][self.node_id])
            return EXIT_EVICTED
        if plan["generation"] != self.generation:
            self._follow(plan)
        elif self.waiting_for_master is not None:
            self._start_group(plan)
        elif self.group is not None and self.group_state == "running":
            self._watch_group()
        self._publish_progress()
        return None

    # -- generations --------------------------------------------------------------------------
    def _follow(self, plan: dict) -> None:
        """A new generation: stop the old workers, then start ours if this node is a member."""
        self._stop_group()
        self.generation = plan["generation"]
        self.progress.reset()
        if self.node_id not in plan["members"]:
            self._report("spare")
            return
        if not self.preflight_done:
            passed, evidence = preflight(self.run_dir, self.spec.script)
            if not passed:
                self._report("failed", preflight=evidence,
                             failures=[{"kind": "preflight", "describe": "; ".join(evidence["problems"])}])
                return
            self.preflight_done = True
        if plan["members"][0] == self.node_id:
            self.store.put(f"master/{self.generation}", {"addr": self.host, "port": free_port(self.host)})
        self.waiting_for_master = plan
        self._report("starting")
        self._start_group(plan)

    def _start_group(self, plan: dict) -> None:
        master = self.store.get(f"master/{plan['generation']}")
        if master is None:
            return  # the master node's agent has not published its address yet
        self.waiting_for_master = None
        assignment = Assignment(
            job_id=self.spec.job_id, node_id=self.node_id, generation=plan["generation"],
            restart_count=plan["restart_count"], max_restarts=self.spec.max_restarts,
            group_rank=plan["members"].index(self.node_id), group_world_size=len(plan["members"]),
            nproc_per_node=self.spec.nproc_per_node,
            master_addr=master["addr"], master_port=int(master["port"]),
        )
        extra_env = {
            "TRANSOM_STORE": self.store.url,
            "TRANSOM_RUN_DIR": str(self.run_dir),
            "TRANSOM_MONITOR_PORT": str(self.progress.port),
            **self.ckpt.worker_env(),
        }
        if plan.get("restore_step") is not None:
            extra_env["TRANSOM_RESTORE_STEP"] = str(plan["restore_step"])
        self.group = WorkerGroup(assignment, self.spec.script, self.spec.script_args,
                                 self.run_dir / "logs" / f"g{self.generation:03d}", extra_env)
        self.group.start()
        log.info("generation %d: started ranks %s", self.generation,
                 [assignment.global_rank(i) for i in range(assignment.nproc_per_node)])
        self._report("running", pids=self.group.pids)

    def _watch_group(self) -> None:
        state, failures = self.group.poll()
        if state == "running":
            return
        if state == "failed":
            # The first failure decides; the rest of this node's workers cannot go on alone.
            self._report("failed", failures=[f.to_dict() | {"describe": f.describe()} for f in failures])
            self._stop_group()
        else:
            self._report("succeeded")

    def _stop_group(self) -> None:
        self.waiting_for_master = None
        if self.group is not None:
            self.group.stop()
            self.group = None

    def _publish_progress(self) -> None:
        step = self.progress.newest_step()
        if (step != self._published_step and self.group_state == "running"
                and time.monotonic() - self._published_at >= PROGRESS_PUBLISH_S):
            self._report("running", pids=self.group.pids if self.group else [])
