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

from transom.common.env import FAULTS as FAULTS_ENV
from transom.config import JobSpec
from transom.control.ckpt_node import NodeCheckpointServer
from transom.control.preflight import preflight
from transom.control.warm import WarmPool
from transom.control.workers import Assignment, WorkerGroup
from transom.faults import FaultInjector
from transom.monitor import detectors
from transom.monitor.node import NodeMonitor
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
        self.preflight_result: tuple[bool, dict] | None = None
        self.monitor = NodeMonitor(node_id)
        self.faults: FaultInjector | None = None
        self.last_store_ok = time.monotonic()
        self._published: tuple = (None, 0)  # (step, warm interpreters) last published
        self._published_at = 0.0
        self._published_extra: dict = {}
        self.warm: WarmPool | None = None
        self.ckpt: NodeCheckpointServer | None = None

    # -- registration -------------------------------------------------------------------------
    def _register(self) -> None:
        assert self.spec is not None
        self.lease = self.store.lease(self.spec.node_ttl_s)
        self.lease_lost.clear()
        self.store.put(
            f"nodes/{self.node_id}",
            {
                "node": self.node_id,
                "host": self.host,
                "pid": os.getpid(),
                "since": time.time(),
            },
            lease=self.lease,
        )
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
        self._published_extra = extra
        value = {
            "node": self.node_id,
            "generation": self.generation,
            "state": state,
            "time": time.time(),
            "step": self.monitor.newest_step(),
            "warm": self.warm.warm_count() if self.warm else 0,
            **extra,
        }
        # Not leased: the last status of a dead node stays readable; liveness is `nodes/<node>`.
        self.store.put(f"status/{self.node_id}", value)
        self._published = (value["step"], value["warm"])
        self._published_at = time.monotonic()

    # -- main loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Serve the job until it ends; the exit code says how it ended for this node."""
        self.spec = JobSpec.from_dict(self.store.wait_for("spec", SPEC_WAIT_S))
        if self.spec.warm_workers:
            # The job id makes warm interpreters findable as the job's own processes.
            env = {"OMP_NUM_THREADS": "1", **os.environ, "TRANSOM_JOB_ID": self.spec.job_id}
            self.warm = WarmPool(
                self.spec.nproc_per_node, env, self.run_dir / "logs" / f"warm-{self.node_id}.log"
            )
            self.warm.fill()
        self.faults = FaultInjector(self.store, self.node_id, self.spec.faults)
        self.ckpt = NodeCheckpointServer(
            self.spec, self.store, self.node_id, self.run_dir, self.host
        )
        self.ckpt.start()
        self._register()
        threading.Thread(target=self._keep_alive, name="lease-keepalive", daemon=True).start()
        self._preflight()
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
            if self.warm is not None:
                self.warm.close()
            self.monitor.close()
            if self.ckpt is not None:
                self.ckpt.stop()
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
                log.warning(
                    "cut off from etcd for %.0f s (%s): stopping workers", self.spec.node_ttl_s, e
                )
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
        self._monitor_tick()
        self._publish_progress()
        if self.warm is not None and self.waiting_for_master is None:
            self.warm.fill(
                workers_progressing=self.group is None or self.monitor.newest_step() is not None
            )
        return None

    # -- generations --------------------------------------------------------------------------
    def _follow(self, plan: dict) -> None:
        """A new generation: stop the old workers, then start ours if this node is a member."""
        self._stop_group()
        self.generation = plan["generation"]
        self.monitor.new_generation(self.generation)
        if self.node_id not in plan["members"]:
            self._report("spare")
            return
        passed, evidence = self.preflight_result
        if not passed:
            self._report(
                "failed",
                preflight=evidence,
                failures=[{"kind": "preflight", "describe": "; ".join(evidence["problems"])}],
            )
            return
        if plan["members"][0] == self.node_id:
            self.store.put(
                f"master/{self.generation}", {"addr": self.host, "port": free_port(self.host)}
            )
        self.waiting_for_master = plan
        self._report("starting")
        self._start_group(plan)

    def _preflight(self) -> None:
        """Check this node once, when it joins, and publish the result for the controller to compare."""
        slowdown = self.faults.on_preflight()  # 1.0 unless a slow_preflight fault aims here
        self.preflight_result = preflight(self.run_dir, self.spec.script, slowdown)
        passed, evidence = self.preflight_result
        self.store.put(
            f"preflight/{self.node_id}", {"passed": passed, "time": time.time(), **evidence}
        )

    def _start_group(self, plan: dict) -> None:
        master = self.store.get(f"master/{plan['generation']}")
        if master is None:
            return  # the master node's agent has not published its address yet
        self.waiting_for_master = None
        assignment = Assignment(
            job_id=self.spec.job_id,
            node_id=self.node_id,
            generation=plan["generation"],
            restart_count=plan["restart_count"],
            max_restarts=self.spec.max_restarts,
            group_rank=plan["members"].index(self.node_id),
            group_world_size=len(plan["members"]),
            nproc_per_node=self.spec.nproc_per_node,
            master_addr=master["addr"],
            master_port=int(master["port"]),
        )
        local_ranks = [assignment.global_rank(i) for i in range(assignment.nproc_per_node)]
        extra_env = {
            FAULTS_ENV: self.faults.on_generation(plan["generation"], local_ranks),
            "TRANSOM_STORE": self.store.url,
            "TRANSOM_RUN_DIR": str(self.run_dir),
            "TRANSOM_MONITOR_PORT": str(self.monitor.port),
            **self.ckpt.worker_env(),
        }
        if plan.get("restore_step") is not None:
            extra_env["TRANSOM_RESTORE_STEP"] = str(plan["restore_step"])
        self.group = WorkerGroup(
            assignment,
            self.spec.script,
            self.spec.script_args,
            self.run_dir / "logs" / f"g{self.generation:03d}",
            extra_env,
        )
        self.group.start(self.warm)
        log.info(
            "generation %d: started ranks %s",
            self.generation,
            [assignment.global_rank(i) for i in range(assignment.nproc_per_node)],
        )
        self._report("running", pids=self.group.pids)

    def _watch_group(self) -> None:
        state, failures = self.group.poll()
        if state == "running":
            return
        if state == "failed":
            # The first failure decides; the rest of this node's workers cannot go on alone.
            self.monitor.raise_anomaly(
                detectors.crash(
                    self.node_id, [f.to_dict() | {"describe": f.describe()} for f in failures]
                )
            )
            self._monitor_tick()
            self._report(
                "failed", failures=[f.to_dict() | {"describe": f.describe()} for f in failures]
            )
            self._stop_group()
        else:
            self._report("succeeded")

    def _monitor_tick(self) -> None:
        """Fire due faults, run the node's detectors, publish the summary and new anomalies."""
        g = self.group
        if g is not None and self.group_state == "running":
            ranks = [g.assignment.global_rank(i) for i in range(len(g.processes))]
            pids = {int(rank): pid for rank, pid in g.pids.items()}
            logs = dict(zip(ranks, g.log_paths))
            steps = self.monitor.steps()
            self.faults.on_agent_tick({r: steps.get(r) for r in ranks}, pids, logs)
            self.monitor.check(pids, logs)
        for fault, rank, step, when in self.monitor.take_fired_faults():
            self.faults.on_worker_fired(fault, rank, step, when)
        if not self.monitor.due(time.monotonic()):
            return
        summary, events = self.monitor.collect()
        for e in events:
            self.store.put(f"events/{int(e['time'] * 1e9):020d}-{self.node_id}-{e['id']}", e)
        if g is not None or events:
            self.store.put(f"monitor/{self.node_id}", summary)

    def _stop_group(self) -> None:
        self.waiting_for_master = None
        if self.group is not None:
            self.group.stop()
            self.group = None

    def _publish_progress(self) -> None:
        """Re-publish this node's status when its newest step or warm interpreters changed."""
        now = (self.monitor.newest_step(), self.warm.warm_count() if self.warm else 0)
        if (
            now != self._published
            and self.group_state in ("running", "spare")
            and time.monotonic() - self._published_at >= PROGRESS_PUBLISH_S
        ):
            self._report(self.group_state, **self._published_extra)
