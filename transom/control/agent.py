"""The node agent: one per node; registers the node, follows the controller's plan, runs workers.

The agent registers its node in etcd under a lease it keeps alive (the node's death is the
lease's expiry; transom.control.lease_keeper), follows the plan through an etcd watch
(transom.control.plan_follow: etcd pushes each new plan, nothing is polled), and for each new
generation stops the old workers and, when the node is a member, starts the new ones (its
checkpoint server starts while it registers and runs its pre-flight checks, once, on joining).
It reports what its workers do to `status/<node>` and `monitor/<node>`, each written only when
it changed or at a slow heartbeat (transom.control.node_reports). Its loop ticks every TICK_S to
watch its workers, every STEADY_TICK_S while they train steadily (a tick then checks only what
is measured in seconds), and when its ranks' stacks are due (a stopped rank's hang waits for
them); a tick costs etcd nothing unless something is to be written. What cannot wait wakes the
loop: a new plan, a worker's exit, a datagram with news (transom.monitor.node). The controller
decides, the agent never restarts workers on its own.

A fault of the control plane never ends the agent: an etcd call that fails (`StoreError`, after
the store's own retries), or a lease renewal that fails or goes unanswered, is an outage; the
workers train on through a short one (their collectives never need etcd) and are paused
(SIGSTOP) before the node's lease can expire, so an old generation never runs beside a new one
(the rule: transom.control.fence; the one clock it counts from, when this node last reached
etcd, and its numbers: transom.control.node_contact); reports wait for etcd to come back, the
plan is read again and its watch reconnected, a lease that expired meanwhile is taken again
under the same node id, and paused workers resume if the plan still has the node in their
generation.
SIGTERM (a scheduler's stop) ends the agent cleanly: workers stopped, the checkpoint server
told to free its shared memory, the node deregistered, exit 0. An evicted agent stops and
exits; an agent restarted under an evicted node's id (a new incarnation) waits for the
controller to take it back as a spare.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from transom.common import env, files, keys
from transom.common.records import MasterAddress, NodeRegistration, Plan, PreflightResult
from transom.common.states import JobState, NodeState
from transom.control import bootstrap, links
from transom.control.ckpt_node import NodeCheckpointServer
from transom.control.fence import PauseGuard, fenced, until_reached
from transom.control.lease_keeper import LeaseKeeper
from transom.control.leaving import close_all, deregister
from transom.control.node_contact import NodeContact
from transom.control.node_reports import STARTING_QUIET_S, NodeReports
from transom.control.plan_follow import PlanFollower
from transom.control.preflight import failed_checks, joining_checks
from transom.control.store_host import TorchStore
from transom.control.warm import WarmPool
from transom.control.warm_template import interpreter_env
from transom.control.workers import Assignment, WorkerGroup
from transom.faults import FaultInjector
from transom.job_spec import JobSpec
from transom.monitor import detectors
from transom.monitor.node import NodeMonitor
from transom.store import Store, StoreError
from transom.store.etcd_client import Lease
from transom.store.spec import SPEC_WAIT_S, read_spec
from transom.utils.net import bind_address

log = logging.getLogger("transom.agent")

TICK_S = 0.2  # the local loop (workers, monitor, warm pool); it costs etcd nothing by itself
STEADY_TICK_S = 0.5  # ... while the workers train steadily (5 a second: half the agent's CPU)
EXIT_EVICTED = 3


class NodeAgent:
    def __init__(self, store: Store, node_id: str, run_dir: Path, host: str = "127.0.0.1"):
        self.store = store
        self.node_id = node_id
        self.run_dir = Path(run_dir)
        # Where every port of this node listens and what peers connect to (never a wildcard).
        self.host = bind_address(store.url, host)
        # This agent process among all that ever ran as `node_id` (a restarted pod is a new one).
        self.incarnation = uuid.uuid4().hex
        self.spec: JobSpec | None = None
        self.lease: Lease | None = None
        self.stopping = threading.Event()
        # When this node last reached etcd: fed by the keeper's renewals and leases' grants.
        self.contact = NodeContact(f"agent {node_id}", time.monotonic(), logger=log)
        self.keeper = LeaseKeeper(store, self.contact, self.stopping)
        self.guard = PauseGuard(self.keeper, self._pause_group, self.stopping)  # control.fence
        self.plan = PlanFollower(store)
        self.terminated = False  # SIGTERM: leave the job cleanly, exit 0
        self.generation = 0
        self.group: WorkerGroup | None = None
        self.group_started_at = 0.0  # monotonic
        self.group_state = NodeState.IDLE
        self.waiting_for_master: Plan | None = None  # the plan whose master address we await
        self.unpublished_master: MasterAddress | None = None  # ours, not yet in etcd
        self.published_master: MasterAddress | None = None  # ours, in etcd
        self.preflight_result: PreflightResult | None = None
        self.monitor: NodeMonitor | None = None
        self.faults: FaultInjector | None = None
        self.reports = NodeReports(store, node_id, self.incarnation, self._facts)
        self._resync = False  # read the plan again and reconnect its watch (after an outage)
        self._lease_loss_seen = False
        self._waiting_to_rejoin = False
        self.warm: WarmPool | None = None
        self.ckpt: NodeCheckpointServer | None = None
        self.link_server: links.LinkServer | None = None  # peers' pre-flight link tests
        self.torch_store: TorchStore | None = None  # while this node is a generation's master

    # -- registration -------------------------------------------------------------------------
    def _register(self) -> None:
        assert self.spec is not None
        lease = self.store.lease(self.spec.node_ttl_s)
        registration = NodeRegistration(
            self.node_id, self.host, os.getpid(), time.time(), incarnation=self.incarnation
        )
        self.store.put(keys.node(self.node_id), registration.to_dict(), lease=lease)
        self.lease = lease
        self.keeper.hold(lease)
        if self.ckpt is not None:  # its server lists under the node's lease
            self.ckpt.use_lease(lease.id)
        self._lease_loss_seen = False
        self._report(self.group_state, **self.reports.extra)

    def _report(self, state: NodeState, quiet_s: float = 0.0, **extra: Any) -> None:
        """Publish this node's status (inside a turn: at its end; `quiet_s`: only if it lasts
        that long); during an outage it is published when etcd is back."""
        self.group_state = state
        self.reports.status(state, quiet_s, **extra)

    def _facts(self) -> tuple[int, int | None, int]:
        """(generation, newest step, warm interpreters): what a status says besides its state."""
        step = self.monitor.newest_step() if self.monitor else None
        return self.generation, step, self.warm.warm_count() if self.warm else 0

    # -- start-up and shutdown ----------------------------------------------------------------
    def run(self) -> int:
        """Serve the job until it ends; the exit code says how it ended for this node.

        Nothing started here outlives it, whichever way it ends."""
        previous = self._catch_sigterm()
        code = 1
        try:
            code = self._serve()
        except StoreError as e:  # only start-up gives up on etcd (fence.STARTUP_WAIT_S)
            if not self.terminated:
                log.error("node %s: %s", self.node_id, e)
            code = 0 if self.terminated else 1
        finally:
            self._close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            log.info("agent of %s exits with code %d", self.node_id, code)
        return code

    def _catch_sigterm(self) -> Callable[[int, FrameType | None], Any] | int | None:
        if threading.current_thread() is not threading.main_thread():
            return None  # signals reach the main thread only (an agent run in a test thread)

        def leave(signum: int, frame: FrameType | None) -> None:
            if not self.terminated:
                log.warning("SIGTERM: leaving the job (stopping workers, deregistering)")
            self.terminated = True
            self.stopping.set()

        return signal.signal(signal.SIGTERM, leave)

    def _serve(self) -> int:
        self._join()
        while not self.stopping.is_set():
            outcome = self._turn()
            if outcome is not None:
                return outcome
            self.plan.wait(self._tick_s())  # returns at once when woken (a new plan, news)
        return 0

    def _tick_s(self) -> float:
        """STEADY_TICK_S while the workers run and nothing here is under way, else TICK_S; less
        when the ranks' stacks are due sooner (NodeMonitor.stuck_check_at)."""
        under_way = self._resync or self.contact.in_outage or self.waiting_for_master is not None
        faults = self.faults is not None and self.faults.agent_faults_left()  # fire near a step
        running = self.group is not None and self.group_state is NodeState.RUNNING
        tick = STEADY_TICK_S if running and not (under_way or faults) else TICK_S
        due = self.monitor.stuck_check_at if self.monitor is not None else None
        return tick if due is None else min(tick, max(0.01, due - time.monotonic()))

    def _join(self) -> None:
        """Start the node's parts, register it and follow the plan (each until done or stopped)."""
        self.spec = spec = until_reached(
            "read the job spec",
            lambda: read_spec(self.store, SPEC_WAIT_S, check_script=True, reader=self.node_id),
            self.stopping,
        )
        self.contact.ttl_s = spec.node_ttl_s
        self.monitor = NodeMonitor(
            self.node_id, str(self.run_dir), spec.hang_floor_s, spec.script, wake=self.plan.wake
        )
        if spec.warm_workers:
            self.warm = WarmPool(
                spec.nproc_per_node,
                interpreter_env(os.environ, spec.job_id),
                files.warm_log(self.run_dir, self.node_id),
                self.node_id,  # in its title: `ps` on a machine of several nodes tells them apart
            )
            self.warm.fill()
        self.reports.hang_floor_s = spec.hang_floor_s  # bounds how long a summary may stand
        self.faults = FaultInjector(self.store, self.node_id, spec.faults)
        self.ckpt = NodeCheckpointServer(spec, self.store, self.node_id, self.run_dir, self.host)
        until_reached("launch the checkpoint server", self.ckpt.launch, self.stopping)
        until_reached("register the node", self._register, self.stopping)
        self.keeper.start(spec.node_ttl_s)
        self.guard.start()
        until_reached("publish the pre-flight result", self._preflight, self.stopping)
        until_reached("start the checkpoint server", self.ckpt.start_patiently, self.stopping)
        until_reached("read the plan", lambda: self.plan.start(time.monotonic()), self.stopping)
        log.info("node %s registered", self.node_id)

    def _close(self) -> None:
        """Stop everything this agent started; each step runs even if an earlier one failed."""
        self.stopping.set()
        close_all(
            ("stop the workers", self._stop_group),
            ("stop the checkpoint server", lambda: self.ckpt.stop() if self.ckpt else None),
            ("close the warm pool", lambda: self.warm.close() if self.warm else None),
            ("close the monitor", lambda: self.monitor.close() if self.monitor else None),
            ("close the link port", lambda: self.link_server.close() if self.link_server else None),
            ("stop following the plan", self.plan.stop),
            ("deregister", self._deregister),
        )

    def _deregister(self) -> None:
        """Not during an outage: each call would wait out the store's deadline, and the lease
        expires by itself within the TTL (a scheduler's grace period is 30 s)."""
        if not self.contact.in_outage:
            deregister(self.store, self.node_id, self.lease, self.terminated)
            self.lease = None
            self.keeper.hold(None)

    # -- main loop ----------------------------------------------------------------------------
    def _turn(self) -> int | None:
        """One turn of the loop: a tick while etcd answers, the fence rule while it does not."""
        in_outage = self.contact.check(time.monotonic())  # by the renewals' word: polls nothing
        self.reports.held, self.reports.failure = in_outage, None
        if not in_outage:
            try:
                with self.reports.batch():  # the turn's writes: one request at its end
                    outcome = self._tick()
            except StoreError as e:
                outcome, self.reports.failure = None, e
            failure = self.reports.failure  # a call that failed, or a write the tick let pass
            if failure is None or outcome is not None:
                return outcome
            self.contact.failed(failure)
            self.reports.held = True
        self._resync = True
        self._offline()
        return None

    def _offline(self) -> None:
        """etcd cannot be reached: give the workers up after --store-outage (control.fence;
        the PauseGuard thread pauses them before the lease can expire)."""
        assert self.spec is not None
        if self.group is None or self.group_state is not NodeState.RUNNING:
            return
        self._watch_group()  # a worker that failed meanwhile stops the group (reported later)
        if self.group is None or self.group_state is not NodeState.RUNNING:
            return
        reason = self.contact.fence_due(time.monotonic(), self.spec.store_outage_s)
        if reason is not None:
            log.warning("fencing this node: %s: killing its workers", reason)
            self._stop_group()
            self._report(NodeState.FAILED, failures=[fenced(reason)])

    def _pause_group(self, reason: str) -> None:
        """The guard's (or a tick's) call: freeze running workers; resumed only on a fresh plan."""
        group = self.group
        if group is None or not group.pause(time.monotonic()):
            return
        self._resync = True
        log.warning("pausing this node's workers: %s (resumed if the plan still has them)", reason)

    def _resume_group(self, plan: Plan) -> None:
        """etcd answers again and the plan still has this node in its generation: train on."""
        assert self.group is not None and self.monitor is not None
        if self.group.paused_at is None or plan.generation != self.generation:
            return  # not paused; or the generation went on: _follow kills the paused workers
        if self._resync or self.guard.due() is not None:
            return  # the plan predates the pause, or the lease may still expire: not yet
        paused_s = time.monotonic() - self.group.paused_at
        self.monitor.excuse(paused_s)  # first: no datagram comes from a paused worker
        self.group.resume()
        log.warning("workers resumed after %.1f s paused: the job still has this node", paused_s)

    def _tick(self) -> int | None:
        assert self.spec is not None and self.ckpt is not None
        now = time.monotonic()
        try:
            self.ckpt.ensure_running()
        except (RuntimeError, OSError) as e:  # workers fall back to peers and storage; next tick
            log.warning("%s", e)
        lease_lost = self.keeper.lost.is_set()
        if lease_lost and not self._lease_loss_seen:
            self._lease_loss_seen = self._resync = True  # etcd stalled or this node was cut off
            self._pause_group("etcd said this node's lease expired")  # until the plan says
        if self._resync:
            # The newest plan, read now (before taking a lease again, an eviction the watch
            # has not delivered yet must not be missed).
            self.plan.resync(now)
            self._resync = False
        plan = self.plan.current(now)
        if plan is None:
            return None
        if plan.job_state.terminal:
            log.info("job ended: %s", plan.job_state.value)
            return 0 if plan.job_state is JobState.SUCCEEDED else 1
        eviction = plan.evicted.get(self.node_id)
        if eviction is not None:
            if eviction.incarnation and eviction.incarnation != self.incarnation:
                if not self._waiting_to_rejoin:
                    log.warning(
                        "node %s was evicted before this agent started (%s): waiting for the "
                        "controller to take it back as a spare",
                        self.node_id,
                        eviction.reason,
                    )
                self._waiting_to_rejoin = True
                return None
            log.warning("node evicted: %s", eviction.reason)
            return EXIT_EVICTED
        if lease_lost:
            # etcd stalled or this node was cut off, and the controller has not evicted it:
            # take a new lease under the same id and keep the workers.
            self._register()
            log.warning("node lease had expired: registered again, workers kept")
        if self.group is not None:
            self._resume_group(plan)
        if plan.generation != self.generation:
            self._follow(plan)
        elif self.waiting_for_master is not None:
            self._start_group(plan)
        elif self.group is not None and self.group_state is NodeState.RUNNING:
            self._watch_group()
        self._monitor_tick()
        self.reports.progress(time.monotonic())
        if self.warm is not None and self.waiting_for_master is None:
            self.warm.fill()
        return None

    # -- generations --------------------------------------------------------------------------
    def _follow(self, plan: Plan) -> None:
        """A new generation: stop the old workers, then start ours if this node is a member."""
        assert self.monitor is not None
        self._stop_group()
        self.generation = plan.generation
        self.monitor.new_generation(self.generation)
        if self.node_id not in plan.members:
            self._report(NodeState.SPARE)
            return
        assert self.preflight_result is not None
        checked = self.preflight_result
        if not checked.passed:
            self._report(NodeState.FAILED, preflight=checked, failures=[failed_checks(checked)])
            return
        if plan.members[0] == self.node_id:
            self.torch_store = TorchStore(self.host)  # the generation's rendezvous, on our address
            self.unpublished_master = MasterAddress(self.host, self.torch_store.port)
        self.waiting_for_master = plan
        self._start_group(plan)  # the master node publishes its address before anything else
        if self.group is None:
            # Waiting for the master node's address, which nearly always comes within a few
            # ticks: said only if the wait lasts.
            self._report(NodeState.STARTING, quiet_s=STARTING_QUIET_S)

    def _preflight(self) -> None:
        """Check this node once, when it joins; publish the result for the controller to compare."""
        assert self.spec is not None and self.faults is not None
        if self.preflight_result is None:
            if self.link_server is None:
                self.link_server = links.LinkServer(self.host, self.faults.link_delay_s)
            self.preflight_result = joining_checks(
                self.store,
                self.node_id,
                self.lease,
                self.link_server,
                self.spec,
                self.run_dir,
                self.faults,
            )
        self.preflight_result.time = time.time()
        self.store.put(keys.preflight(self.node_id), self.preflight_result.to_dict())

    def _start_group(self, plan: Plan) -> None:
        """Start this node's workers once the master address is known (the master node's
        agent publishes it; the plan's watch brings it to the others, who wait for it without
        a read). An etcd call failing leaves the start to be retried next tick."""
        if self.unpublished_master is not None:
            self.store.put(keys.master(plan.generation), self.unpublished_master.to_dict())
            self.published_master = self.unpublished_master
            self.unpublished_master = None
        # Ours (the master node's, for this generation only) or the one the plan's watch brought.
        master = self.published_master or self.plan.master(plan.generation)
        if master is None:
            return  # the master node's agent has not published its address yet
        assert self.spec is not None and self.ckpt is not None and self.faults is not None
        assert self.monitor is not None
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
            **plan.restore_env(),
        }
        log_dir = files.generation_logs(self.run_dir, self.generation)
        stacks_dir = log_dir if self.spec.auto_monitor else None  # and the zero-code monitor
        evidence = files.evidence_dir(self.run_dir, self.node_id)
        extra_env.update(bootstrap.instrumentation_env(stacks_dir, evidence))
        self.waiting_for_master = None
        self.monitor.expect_ranks(local_ranks, stacks_dir)
        spec = self.spec
        if self.torch_store is not None and self.torch_store.proc is None:  # before the ranks
            self.torch_store.start(self.warm, log_dir / files.TORCH_STORE_LOG)
        self.group = WorkerGroup(assignment, spec.script, spec.script_args, log_dir, extra_env)
        self.group.start(self.warm, on_exit=lambda pid: self.plan.wake())  # no tick's wait
        self.group_started_at = time.monotonic()
        how = self.group.started_as  # warm, importing or cold: what the start-up cost
        log.info("generation %d: started ranks %s %s", self.generation, local_ranks, how)
        self._report(NodeState.RUNNING, pids=self.group.pids)

    def _watch_group(self) -> None:
        assert self.group is not None and self.monitor is not None
        polled, failures = self.group.poll()
        state = NodeState(polled)
        if state is NodeState.RUNNING:
            return
        if state is NodeState.FAILED:
            # The first failure decides; the rest of this node's workers cannot go on alone.
            self.monitor.raise_anomaly(detectors.crash(self.node_id, failures))
            self._monitor_tick()
            self._report(NodeState.FAILED, failures=failures)
            self.reports.write_now()  # before stopping the other workers, which takes a while
            self._stop_group()
        else:
            self._report(NodeState.SUCCEEDED)

    def _monitor_tick(self) -> None:
        """Fire due faults, run the node's detectors, publish the summary (when it changed or
        is due, see transom.control.node_reports) and new anomalies; during an outage they wait."""
        assert self.faults is not None and self.monitor is not None
        g = self.group
        try:
            if g is not None and self.group_state is NodeState.RUNNING:
                ranks = [g.assignment.global_rank(i) for i in range(len(g.processes))]
                pids = {int(rank): pid for rank, pid in g.pids.items()}
                logs = dict(zip(ranks, g.log_paths, strict=False))
                steps = self.monitor.steps()
                self.faults.on_agent_tick({r: steps.get(r) for r in ranks}, pids, logs)
                self.monitor.check(pids, logs)
            self.faults.write_held()
            for fault, rank, step, when in self.monitor.take_fired_faults():
                self.faults.on_worker_fired(fault, rank, step, when)
        except StoreError as e:  # a fault's record is test machinery: never stop for it
            log.warning("cannot record a fault: %s", e)
        now = time.monotonic()
        running = g is not None
        # A rule of the controller waits for an answer (`|`: always taken); stragglers, for steps.
        progress = self.monitor.answer(self.plan.summary_request()) | self.monitor.steps_due(now)
        if not (progress or self.monitor.due(now) or (running and self.reports.summary_due(now))):
            return
        summary, events = self.monitor.collect()
        if running or events:
            self.reports.summary(summary, events, now, progress)  # written at the turn's end

    def _stop_group(self) -> None:
        self.waiting_for_master = None
        self.unpublished_master = self.published_master = None
        if self.group is not None:
            self.group.stop()
            self.group = None
        if self.torch_store is not None:
            self.torch_store.close()
            self.torch_store = None
