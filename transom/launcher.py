"""`transom run`: start a job's control plane, controller candidates and node agents, and watch it.

On one machine (no --store) it starts a private etcd (mutual TLS, with certificates made for
this run in RUN_DIR/etcd-tls) and simulates `nnodes + spares` nodes, each a separate agent
process. With --store it joins a job on an existing etcd and runs one agent (or --local-nodes of
them) on this machine, and a controller candidate for each of its nodes among the job's first
live nodes (transom.control.candidacy); every machine runs the same command. Every
process it starts reaches etcd as it does (`StoreAccess.argv`); a spec another machine wrote is
validated before this machine runs it. It mirrors the job's events into the run directory,
keeps `status.json` current, records the job's progress over time (`progress.jsonl`) and shows
a live view (transom.run_mirror; with `Launch.mirror` off, on all but one machine of a large
job, it follows the job's state alone), replaces a controller candidate that died while the job
goes on, and when the job ends (or on Ctrl-C or SIGTERM) stops everything it started, etcd
included.

It rides out etcd's outages: an etcd it cannot reach is logged once when the outage begins and
once when it ends (and an event says how long it lasted); only an outage longer than the
spec's `store_outage_s` ends the job, deliberately and with its reason (exit 1, never the
"bad input" exit 2). Its embedded etcd is restarted from its data directory when it dies, and
kept compacted and defragmented (store/upkeep.py). With `refill_spares` (simulated
nodes only) it plays the cluster's scheduler too: every node the controller evicts or sets
aside is replaced by a newly started one, which joins as a spare, so the pool of spares stays
full (when: transom.spare_refill).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live

from transom.checkpoint.shm_dirs import default_shm_dir
from transom.checkpoint.storage_claim import Claim
from transom.common import files, keys
from transom.common.records import Event, EventKind, JobRecord, RecordError
from transom.common.states import JobState
from transom.control.candidacy import DEFAULT_CANDIDATES, Candidacy, demote_after_s
from transom.control.warm_template import Template
from transom.job_spec import ConfigError, JobSpec
from transom.rerun import hold_run_dir, hold_storage, resume
from transom.run_mirror import JobFollower, RunMirror, with_launch
from transom.spare_refill import SpareRefill
from transom.store import EmbeddedEtcd, Store, StoreAccess, StoreError
from transom.store.embedded import ONE_MACHINE_GO_THREADS
from transom.store.reachability import StoreOutage
from transom.store.spec import parse_spec
from transom.store.upkeep import EtcdUpkeep
from transom.utils.child import Child
from transom.utils.procs import stop_process, stop_tree
from transom.view import snapshot

log = logging.getLogger("transom.run")


def children_log_level() -> str:
    """The controllers' and agents' log level: info, or debug when `transom --log-level debug`
    runs the launcher (the controller then logs every straggler evaluation)."""
    return "debug" if logging.getLogger().isEnabledFor(logging.DEBUG) else "info"


POLL_S = 0.5
STORE_CONNECT_TIMEOUT_S = 5.0
STORE_DEADLINE_S = 2.0  # one poll's etcd calls give up after this; the outage is then counted
SHUTDOWN_GRACE_S = 15.0  # for children to exit by themselves after the job ended
STOP_GRACE_S = 10.0  # for children to clean up after SIGTERM (within a scheduler's 30 s)
UPKEEP_DEADLINE_S = 60.0  # a defragmentation of a large database takes a while
EXIT_FAILED = 1
EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}


class ControlPlaneLost(RuntimeError):
    """The job cannot go on: etcd stayed unreachable longer than the job rides out, or every
    node agent of this machine exited."""


@dataclass
class Launch:
    """How this machine takes part in the job."""

    spec: JobSpec
    run_dir: Path
    store: StoreAccess | None = None  # None: start a private etcd
    local_nodes: int | None = None  # None: all nodes here without --store, else 1
    # The job's controller candidates (None: 2 without --store, else DEFAULT_CANDIDATES).
    controllers: int | None = None
    node_prefix: str | None = None
    host: str = "127.0.0.1"
    refill_spares: bool = False  # simulated nodes only: replace every evicted node with a new one
    # Keep status.json, events.jsonl and progress.jsonl here and show the events (run_mirror.py):
    # one launcher of a job needs to; the others follow the job record alone.
    mirror: bool = True
    total_steps: int | None = None  # shown in the live view's progress bar when known
    # Start over instead of resuming from what the checkpoint storage holds (storage_claim.py);
    # with discard_storage also remove the steps there.
    fresh: bool = False
    discard_storage: bool = False
    children: list[Child] = field(default_factory=list)


class Launcher:
    def __init__(self, launch: Launch, console: Console | None = None):
        self.launch = launch
        self.console = console or Console(soft_wrap=True)
        self.etcd: EmbeddedEtcd | None = None
        self.upkeep: EtcdUpkeep | None = None
        self.store: Store | None = None
        self.outage = StoreOutage("launcher", logger=log)
        self.mirror: RunMirror | JobFollower | None = None  # the job, followed (run_mirror.py)
        self.children: list[Child] = []
        self._local_nodes: list[str] = []
        self.refill = SpareRefill()  # when an evicted node is replaced (refill_spares)
        self._unrecorded: list[Event] = []  # events etcd did not take yet, oldest first
        self.claim: Claim | None = None  # this job's hold on its checkpoint storage
        self._run_dir_lock: int | None = None  # on one machine: the run directory's lock file
        self.candidacy: Candidacy | None = None  # with --store: which nodes here run a candidate
        self._promotions = 0
        self.template: Template | None = None  # several nodes here: their warm template

    @property
    def connected(self) -> Store:
        """The job's store (connected by `run` before anything uses it)."""
        assert self.store is not None
        return self.store

    # -- set-up -------------------------------------------------------------------------------
    def _connect(self) -> Store:
        L = self.launch
        if L.store is None:
            self._run_dir_lock = hold_run_dir(L.run_dir)
            self._start_template()  # the run directory is ours: its imports overlap etcd's start
            self.etcd = EmbeddedEtcd(
                L.run_dir / files.ETCD,
                log_path=files.log_file(L.run_dir, "etcd"),
                tls_dir=L.run_dir / files.ETCD_TLS,
                go_threads=ONE_MACHINE_GO_THREADS,
            ).start()
            access = self.etcd.access
            self.upkeep = EtcdUpkeep(
                Store(
                    access, L.spec.job_id, timeout=UPKEEP_DEADLINE_S, deadline_s=UPKEEP_DEADLINE_S
                ),
                self.etcd.quota_bytes,
            ).start()
        else:
            access = L.store
        store = Store(access, L.spec.job_id, deadline_s=STORE_DEADLINE_S)
        try:
            store.wait_healthy(STORE_CONNECT_TIMEOUT_S)
        except StoreError as e:
            raise ConfigError(f"--store: {e}") from e
        return store

    def _publish_spec(self) -> None:
        """Publish this machine's spec, unless another machine did: after this job has claimed
        the spec's checkpoint storage, and (the first machine) listed the steps there it
        resumes from (storage_claim.py), so that its first plan restores the newest of them."""
        job = _job_record(self.connected.get(keys.JOB))
        if job and job.state.terminal:
            raise ConfigError(
                f"job {self.launch.spec.job_id} already ended ({job.state.value}); "
                f"choose another --job-id"
            )
        L = self.launch
        existing = self.connected.get(keys.SPEC)
        spec = L.spec if existing is None else parse_spec(existing, L.spec.job_id, True)
        if spec.ckpt_storage is None:  # the default, made explicit for every machine
            spec.ckpt_storage = str(L.run_dir / files.CHECKPOINTS)
        root = Path(spec.ckpt_storage)
        self.claim = hold_storage(root, L.spec.job_id, L.fresh, L.discard_storage)
        if existing is None and (event := resume(self.connected, self.claim)) is not None:
            log.warning("%s", event.message)  # the job's first event: where it resumes from
            self._event(event)
        if existing is None and self.connected.create(keys.SPEC, spec.to_dict()):
            return
        if existing is None:  # another machine wrote it meanwhile: check it first
            spec = parse_spec(self.connected.get(keys.SPEC), L.spec.job_id, check_script=True)
        log.info("joining job %s (spec written by another machine)", spec.job_id)

    def _agent_count(self) -> int:
        """How many node agents this launcher runs on its machine."""
        L, spec = self.launch, self.launch.spec
        return L.local_nodes or (spec.nnodes_max + spec.spares if L.store is None else 1)

    def _start_template(self) -> None:
        """Several nodes on this machine: their warm interpreters fork from one template's
        imports (control/warm_template.py) instead of each importing torch on the same cores."""
        L = self.launch
        if self.template is None and L.spec.warm_workers and self._agent_count() > 1:
            self.template = Template(L.spec.job_id, files.log_file(L.run_dir, "warm-template"))
            self.template.start()

    def _children(self) -> list[Child]:
        L, spec = self.launch, self.launch.spec
        simulated = L.store is None
        n_agents = self._agent_count()
        prefix = L.node_prefix or ("node" if simulated else socket.gethostname())
        children = []
        if not simulated:
            n = L.controllers or DEFAULT_CANDIDATES
            self.candidacy = Candidacy(self.connected, n, demote_after_s(spec))
        for i in range((L.controllers or 2) if simulated else 0):
            name = f"controller-{L.node_prefix or socket.gethostname()}-{i}"  # unique per node
            children.append(
                Child(
                    name,
                    "controller",
                    [*self._argv("controller"), "--candidate-id", name],
                    files.log_file(L.run_dir, name),
                )
            )
        for i in range(n_agents):
            children.append(self._agent(f"{prefix}{i}" if (simulated or n_agents > 1) else prefix))
        self._local_nodes = [c.name for c in children if c.kind == "agent"]
        return children

    def _argv(self, command: str) -> list[str]:
        """The command line of a child running `transom <command>` for this job."""
        base = [sys.executable, "-m", "transom", "--log-level", children_log_level(), command]
        return [*base, *self.connected.access.argv(), "--job-id", self.launch.spec.job_id]

    def _agent(self, name: str) -> Child:
        L = self.launch
        argv = [*self._argv("agent"), "--node-id", name, "--run-dir", str(L.run_dir)]
        env = self.template.agent_env() if self.template is not None else None
        log_path = files.agent_log(L.run_dir, name)
        return Child(name, "agent", [*argv, "--host", L.host], log_path, env=env)

    # -- running ------------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job to its end; the exit code is 0 if it succeeded."""
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        received: list[int] = []

        def interrupt(signum, frame):
            if not received:  # a second signal while stopping must not cut the clean-up short
                received.append(signum)
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, interrupt)
        signal.signal(signal.SIGTERM, interrupt)
        try:
            self.store = self._connect()
            self._start_template()
            self._publish_spec()
            self.children = self._children()
            for child in self.children:
                child.start()
            job = self._watch()
            if job.state is JobState.SUCCEEDED:
                self.console.print(
                    f"[green]job {self.launch.spec.job_id} succeeded[/]: {job.reason}"
                )
                return 0
            print(f"transom: job {self.launch.spec.job_id} failed: {job.reason}", file=sys.stderr)
            return EXIT_FAILED
        except KeyboardInterrupt:
            received[:] = received or [signal.SIGINT]
            self._shutdown(wait_for_exit=False)
            print("transom: interrupted; stopped every process of the job", file=sys.stderr)
            return EXIT_INTERRUPTED.get(signal.Signals(received[0]), 130)
        except (ControlPlaneLost, StoreError) as e:
            if self.store is None:
                raise  # etcd never answered: the options are wrong (the "bad input" exit)
            self._shutdown(wait_for_exit=False)
            print(f"transom: job {self.launch.spec.job_id} stopped: {e}", file=sys.stderr)
            return EXIT_FAILED
        finally:
            received.append(0)  # from here on, signals are ignored until the handlers return
            self._shutdown()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _watch(self) -> JobRecord:
        """Mirror events and status until the job is over; return the final job record."""
        live = None
        if self.console.is_terminal:
            live = Live(console=self.console, refresh_per_second=4, transient=False)
            live.start()
        try:
            while True:
                self._keep_etcd()
                job = self._poll(live)
                if job and job.state.terminal:
                    return job
                self._keep_controllers()
                if (
                    not any(c.alive() for c in self.children if c.kind == "agent")
                    and self.launch.store is None
                ):
                    raise ControlPlaneLost(
                        "every node agent exited before the job ended; see the logs in "
                        f"{self.launch.run_dir / files.LOGS}"
                    )
                time.sleep(POLL_S)
        finally:
            if live is not None:
                live.stop()

    def _poll(self, live: Live | None) -> JobRecord | None:
        """One round: mirror, refill; the job record (None during an outage).

        The job record comes pushed by a watch, and is read directly every run_mirror.PROBE_S
        (etcd's answer is the outage count's evidence); a mirror's other keys come from its
        own watch: while nothing changes, the launcher costs etcd one read every PROBE_S."""
        began = time.monotonic()
        try:
            if self.mirror is None:
                self.mirror = (
                    RunMirror(
                        self.connected, self.launch.run_dir, self.console, self.launch.total_steps
                    )
                    if self.launch.mirror
                    else JobFollower(self.connected)
                )
            job_value = self.mirror.value(began)
            job = _job_record(job_value)
            if isinstance(self.mirror, RunMirror):
                self.mirror.show(began, job_value, bool(job and job.state.terminal), live)
            if self.launch.refill_spares and self.launch.store is None:
                self._refill(job)
        except StoreError as e:
            lasted = self.outage.failed(e, began)
            limit = self.launch.spec.store_outage_s
            if lasted > limit:
                raise ControlPlaneLost(
                    f"etcd unreachable for {lasted:.0f} s, longer than the job rides out "
                    f"(--store-outage {limit:g} s); last error: {e}"
                ) from e
            return None
        reason, ended = self.outage.reason, self.outage.ok()
        if ended is not None:
            message = (
                f"launcher: etcd was unreachable for {ended:.1f} s ({reason}); the job went on"
            )
            self._event(Event(time.time(), EventKind.WARNING, message))
        else:
            self._record()
        return job

    def _keep_etcd(self) -> None:
        """Start the embedded etcd again (same data, ports, certificates) if it died."""
        if self.etcd is None or self.etcd.alive():
            return
        code = self.etcd.process.returncode if self.etcd.process else None
        log.warning("the embedded etcd exited (code %s); restarting it from its data", code)
        try:
            self.etcd.restart()
        except StoreError as e:  # counted as an outage by the next poll; tried again after it
            log.error("could not restart the embedded etcd: %s", e)
            return
        message = (
            f"launcher: the embedded etcd exited (code {code}) and was restarted from its data "
            f"directory (restart {self.etcd.restarts})"
        )
        self._event(Event(time.time(), EventKind.WARNING, message))

    def _event(self, event: Event) -> None:
        """Record a control-plane event; one etcd cannot take now (a log line says so) is
        recorded after a later poll that reached etcd (one just after an outage may still
        find its writes slow)."""
        self._unrecorded.append(event)
        if not self._record():
            log.warning("%s (not recorded in etcd yet: it does not answer)", event.message)

    def _record(self) -> bool:
        """Write the unrecorded events, oldest first, until one fails; whether all went."""
        while self._unrecorded:
            event = self._unrecorded[0]
            try:
                self.connected.put(keys.event(event.time, "launcher"), event.to_dict())
            except StoreError:
                return False
            self._unrecorded.pop(0)
        return True

    def _refill(self, job: JobRecord | None) -> None:
        """Play the cluster's scheduler: a new simulated node for each lost one (evicted or set
        aside), when transom.spare_refill says."""
        trained = self.mirror.trained_generation if isinstance(self.mirror, RunMirror) else None
        for node in self.refill.due(job, self._local_nodes, trained, time.time()):
            lost = "evicted" if job is not None and node in job.evicted else "set-aside"
            child = self._agent(f"{self.launch.node_prefix or 'node'}{len(self._local_nodes)}")
            self._local_nodes.append(child.name)
            self.children.append(child)
            child.start()
            event = Event(
                time.time(),
                EventKind.PROVISION,
                f"cluster: new node {child.name} started to replace {lost} {node}; "
                f"it joins as a spare (--refill-spares)",
                node=child.name,
                extra={"replaces": node},
            )
            self.connected.put(keys.event(event.time, "launcher"), event.to_dict())

    def _keep_controllers(self) -> None:
        """A controller candidate that died while the job goes on is replaced; with --store, one
        starts or stops as a node of this machine enters or leaves the job's first live ones."""
        if self.candidacy is not None:
            self._keep_candidates(self.candidacy)
        for child in self.children:
            if child.kind == "controller" and child.process and child.process.poll() is not None:
                # A new incarnation gets a new id: fencing compares ids, so ids are never reused.
                child.restarts += 1
                log.info(
                    "controller candidate %s exited (%s); starting a new one",
                    child.name,
                    child.process.returncode,
                )
                child.name = f"{child.base}.{child.restarts}"
                child.argv[child.argv.index("--candidate-id") + 1] = child.name
                child.start()

    def _keep_candidates(self, candidacy: Candidacy) -> None:
        running = {c.node: c for c in self.children if c.kind == "controller" and c.node}
        try:
            keep = candidacy.keep(self._local_nodes, running, time.monotonic())
        except StoreError:  # etcd does not answer now: the candidates here stay as they are
            return
        for node in sorted(keep - set(running)):
            self._promotions += 1  # ids are never reused, not even by a node promoted again
            name = f"controller-{node}-{self._promotions}"
            argv = [*self._argv("controller"), "--candidate-id", name]
            child = Child(name, "controller", argv, files.log_file(self.launch.run_dir, name))
            child.node = node
            log.info("node %s is among the job's first live nodes: starting %s", node, name)
            self.children.append(child)
            child.start()
        for node in set(running) - keep:
            log.info("node %s is no longer a controller candidate", node)
            running[node].kind = "retired"
            if (process := running[node].process) is not None and process.poll() is None:
                process.terminate()  # it hands leadership over at once if it leads

    def _shutdown(self, wait_for_exit: bool = True) -> None:
        if self.candidacy is not None:
            self.candidacy.stop()
        if self.mirror is not None:
            self.mirror.stop()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for child in self.children:  # they exit by themselves once the job has ended
            if wait_for_exit and child.process is not None:
                try:
                    child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        # All at once (SIGTERM, then SIGKILL after STOP_GRACE_S), so stopping N children takes
        # one grace period, not N.
        running = [c.process for c in self.children if c.process and c.process.poll() is None]
        stop_tree([p.pid for p in running], STOP_GRACE_S)
        for child in self.children:
            if child.process is not None:
                stop_process(child.process, grace_s=1.0)  # reaps it (and kills a straggler)
        if self.store is not None and self.etcd is not None and self.children:
            try:
                (self.launch.run_dir / files.STATUS).write_text(
                    json.dumps(with_launch(snapshot(self.store)), indent=1)
                )
            except StoreError:
                pass
        self.children = []
        if self.template is not None:
            self.template.stop()
            self.template = None
        for node in (
            self._local_nodes
        ):  # a node agent killed with SIGKILL left its checkpoint memory behind
            shutil.rmtree(default_shm_dir(self.launch.spec.job_id, node), ignore_errors=True)
        if self.upkeep is not None:
            self.upkeep.stop()
            self.upkeep = None
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        if self.claim is not None:
            self.claim.release()
            self.claim = None
        if self._run_dir_lock is not None:
            os.close(self._run_dir_lock)
            self._run_dir_lock = None


def _job_record(value: object) -> JobRecord | None:
    """The stored job record, or None when there is none (or it is not a valid one yet)."""
    try:
        return JobRecord.from_dict(value) if value else None
    except RecordError:
        return None
