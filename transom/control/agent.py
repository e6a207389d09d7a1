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

from transom.common import env, files, keys
from transom.common.records import (
    MasterAddress,
    NodeRegistration,
    NodeStatus,
    Plan,
    PreflightResult,
    RecordError,
)
from transom.common.states import JobState, NodeState
from transom.config import JobSpec
from transom.control import links
from transom.control.ckpt_node import NodeCheckpointServer
from transom.control.preflight import preflight
from transom.control.warm import WarmPool
from transom.control.workers import Assignment, TorchStore, WorkerGroup
from transom.faults import FaultInjector
from transom.monitor import detectors
from transom.monitor.node import NodeMonitor
from transom.store import Store, StoreError
from transom.store.client import Lease
from transom.store.spec import read_spec
from transom.utils.net import bind_address

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
        # Where every port of this node listens and what peers connect to (never a wildcard).
        self.host = bind_address(store.url, host)
        self.spec: JobSpec | None = None
        self.lease: Lease | None = None
        self.lease_lost = threading.Event()
        self.stopping = threading.Event()
        self.generation = 0
        self.group: WorkerGroup | None = None
        self.group_state = NodeState.IDLE
        self.waiting_for_master: Plan | None = None  # the plan whose master address we await
        self.preflight_result: tuple[bool, dict] | None = None
        self.monitor = NodeMonitor(node_id, scope=str(self.run_dir))
        self.faults: FaultInjector | None = None
        self.last_store_ok = time.monotonic()
        self._published: tuple = (None, 0)  # (step, warm interpreters) last published
        self._published_at = 0.0
        self._published_extra: dict = {}
        self.warm: WarmPool | None = None
        self.ckpt: NodeCheckpointServer | None = None
        self.link_server: links.LinkServer | None = None  # peers' pre-flight link tests
        self.torch_store: TorchStore | None = None  # while this node is a generation's master

    # -- registration -------------------------------------------------------------------------
    def _register(self) -> None:
        assert self.spec is not None
        self.lease = self.store.lease(self.spec.node_ttl_s)
        self.lease_lost.clear()
        registration = NodeRegistration(self.node_id, self.host, os.getpid(), time.time())
        self.store.put(keys.node(self.node_id), registration.to_dict(), lease=self.lease)
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

    def _report(self, state: NodeState, **extra) -> None:
        self.group_state = state
        self._published_extra = extra
        status = NodeStatus(
            node=self.node_id,
            generation=self.generation,
            state=state,
            time=time.time(),
            step=self.monitor.newest_step(),
            warm=self.warm.warm_count() if self.warm else 0,
            **extra,
        )
        # Not leased: the last status of a dead node stays readable; liveness is `nodes/<node>`.
        self.store.put(keys.status(self.node_id), status.to_dict())
        self._published = (status.step, status.warm)
        self._published_at = time.monotonic()

    # -- main loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Serve the job until it ends; the exit code says how it ended for this node."""
        self.spec = read_spec(self.store, SPEC_WAIT_S, check_script=True, reader=self.node_id)
        if self.spec.warm_workers:
            # The job id makes warm interpreters findable as the job's own processes.
            warm_env = {"OMP_NUM_THREADS": "1", **os.environ, env.JOB_ID: self.spec.job_id}
            self.warm = WarmPool(
                self.spec.nproc_per_node, warm_env, files.warm_log(self.run_dir, self.node_id)
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
            if self.link_server is not None:
                self.link_server.close()
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
            stored_plan = self.store.get(keys.PLAN)
            self.last_store_ok = time.monotonic()
            try:
                assert self.ckpt is not None
                self.ckpt.ensure_running()
            except RuntimeError as e:  # workers fall back to peers and storage; retried next tick
                log.warning("%s", e)
        except StoreError as e:
            if self.group and time.monotonic() - self.last_store_ok > self.spec.node_ttl_s:
                log.warning(
                    "cut off from etcd for %.0f s (%s): stopping workers", self.spec.node_ttl_s, e
                )
                self._stop_group()
                self.group_state = NodeState.IDLE
            return None
        if stored_plan is None:
            return None
        try:
            plan = Plan.from_dict(stored_plan)
        except RecordError as e:
            log.warning("ignoring an invalid plan: %s", e)
            return None
        if plan.job_state.terminal:
            log.info("job ended: %s", plan.job_state.value)
            return 0 if plan.job_state is JobState.SUCCEEDED else 1
        if self.node_id in plan.evicted:
            log.warning("node evicted: %s", plan.evicted[self.node_id].reason)
            return EXIT_EVICTED
        if plan.generation != self.generation:
            self._follow(plan)
        elif self.waiting_for_master is not None:
            self._start_group(plan)
        elif self.group is not None and self.group_state is NodeState.RUNNING:
            self._watch_group()
        self._monitor_tick()
        self._publish_progress()
        if self.warm is not None and self.waiting_for_master is None:
            self.warm.fill(
                workers_progressing=self.group is None or self.monitor.newest_step() is not None
            )
        return None

    # -- generations --------------------------------------------------------------------------
    def _follow(self, plan: Plan) -> None:
        """A new generation: stop the old workers, then start ours if this node is a member."""
        self._stop_group()
        self.generation = plan.generation
        self.monitor.new_generation(self.generation)
        if self.node_id not in plan.members:
            self._report(NodeState.SPARE)
            return
        assert self.preflight_result is not None
        passed, evidence = self.preflight_result
        if not passed:
            self._report(
                NodeState.FAILED,
                preflight=evidence,
                failures=[{"kind": "preflight", "describe": "; ".join(evidence["problems"])}],
            )
            return
        if plan.members[0] == self.node_id:
            self.torch_store = TorchStore(self.host)  # the generation's rendezvous, on our address
            master = MasterAddress(self.host, self.torch_store.port)
            self.store.put(keys.master(self.generation), master.to_dict())
        self.waiting_for_master = plan
        self._report(NodeState.STARTING)
        self._start_group(plan)

    def _preflight(self) -> None:
        """Check this node once, when it joins; publish the result for the controller to compare."""
        assert self.spec is not None and self.faults is not None
        slowdown = self.faults.on_preflight()  # 1.0 unless a slow_preflight fault aims here
        self.link_server = links.LinkServer(self.host, self.faults.link_delay_s)
        links.publish(self.store, self.node_id, self.link_server, self.lease)
        self.preflight_result = preflight(self.run_dir, self.spec.script, slowdown)
        peers = self.spec.nnodes_max + self.spec.spares - 1
        self.preflight_result[1].update(
            links.link_test(self.store, self.node_id, peers, self.faults.link_delay_s)
        )
        passed, evidence = self.preflight_result
        result = PreflightResult.from_dict({"passed": passed, "time": time.time(), **evidence})
        self.store.put(keys.preflight(self.node_id), result.to_dict())

    def _start_group(self, plan: Plan) -> None:
        stored = self.store.get(keys.master(plan.generation))
        if stored is None:
            return  # the master node's agent has not published its address yet
        try:
            master = MasterAddress.from_dict(stored)
        except RecordError as e:
            log.warning("invalid master address: %s", e)
            return
        assert self.spec is not None and self.ckpt is not None and self.faults is not None
        self.waiting_for_master = None
        assignment = Assignment(
            job_id=self.spec.job_id,
            node_id=self.node_id,
            generation=plan.generation,
            restart_count=plan.restart_count,
            max_restarts=self.spec.max_restarts,
            group_rank=plan.members.index(self.node_id),
            group_world_size=len(plan.members),
            nproc_per_node=self.spec.nproc_per_node,
            master_addr=master.addr,
            master_port=master.port,
            host=self.host,
        )
        local_ranks = [assignment.global_rank(i) for i in range(assignment.nproc_per_node)]
        extra_env = {
            env.FAULTS: self.faults.on_generation(plan.generation, local_ranks),
            env.STORE: self.store.url,
            env.RUN_DIR: str(self.run_dir),
            env.MONITOR_SOCKET: str(self.monitor.socket_path),
            **self.ckpt.worker_env(),
        }
        if plan.restore_step is not None:
            extra_env[env.RESTORE_STEP] = str(plan.restore_step)
        self.monitor.expect_ranks(local_ranks)
        self.group = WorkerGroup(
            assignment,
            self.spec.script,
            self.spec.script_args,
            files.generation_logs(self.run_dir, self.generation),
            extra_env,
        )
        self.group.start(self.warm)
        log.info(
            "generation %d: started ranks %s",
            self.generation,
            [assignment.global_rank(i) for i in range(assignment.nproc_per_node)],
        )
        self._report(NodeState.RUNNING, pids=self.group.pids)

    def _watch_group(self) -> None:
        assert self.group is not None
        polled, failures = self.group.poll()
        state = NodeState(polled)
        if state is NodeState.RUNNING:
            return
        if state is NodeState.FAILED:
            # The first failure decides; the rest of this node's workers cannot go on alone.
            self.monitor.raise_anomaly(
                detectors.crash(
                    self.node_id, [f.to_dict() | {"describe": f.describe()} for f in failures]
                )
            )
            self._monitor_tick()
            self._report(
                NodeState.FAILED,
                failures=[f.to_dict() | {"describe": f.describe()} for f in failures],
            )
            self._stop_group()
        else:
            self._report(NodeState.SUCCEEDED)

    def _monitor_tick(self) -> None:
        """Fire due faults, run the node's detectors, publish the summary and new anomalies."""
        assert self.faults is not None
        g = self.group
        if g is not None and self.group_state is NodeState.RUNNING:
            ranks = [g.assignment.global_rank(i) for i in range(len(g.processes))]
            pids = {int(rank): pid for rank, pid in g.pids.items()}
            logs = dict(zip(ranks, g.log_paths, strict=False))
            steps = self.monitor.steps()
            self.faults.on_agent_tick({r: steps.get(r) for r in ranks}, pids, logs)
            self.monitor.check(pids, logs)
        for fault, rank, step, when in self.monitor.take_fired_faults():
            self.faults.on_worker_fired(fault, rank, step, when)
        if not self.monitor.due(time.monotonic()):
            return
        summary, events = self.monitor.collect()
        for e in events:
            self.store.put(keys.event(e.time, f"{self.node_id}-{e.id}"), e.to_dict())
        if g is not None or events:
            self.store.put(keys.monitor(self.node_id), summary.to_dict())

    def _stop_group(self) -> None:
        self.waiting_for_master = None
        if self.group is not None:
            self.group.stop()
            self.group = None
        if self.torch_store is not None:
            self.torch_store.close()
            self.torch_store = None

    def _publish_progress(self) -> None:
        """Re-publish this node's status when its newest step or warm interpreters changed."""
        now = (self.monitor.newest_step(), self.warm.warm_count() if self.warm else 0)
        if (
            now != self._published
            and self.group_state in (NodeState.RUNNING, NodeState.SPARE)
            and time.monotonic() - self._published_at >= PROGRESS_PUBLISH_S
        ):
            self._report(self.group_state, **self._published_extra)
