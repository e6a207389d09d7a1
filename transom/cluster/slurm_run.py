"""`transom run` as one task of a Slurm job step: where its etcd is, what its node is called,
what it does with evicted nodes and with the signals Slurm sends.

Every node of the step runs the same command (`srun ... transom run ...`, one task per node). The
step's first node starts the job's etcd on its address (mutual TLS, certificates in the attempt's
folder) and writes the folder's `store.json`; every other node waits for that file and connects. A
requeued or re-submitted job goes on from the checkpoints storage holds, as every rerun of `transom
run` does (the launcher's claim, checkpoint/storage_claim.py). An explicit `--store` wins: then no
node starts one. Each node then runs what `transom run --store` runs on a machine of a multi-machine
job: one agent named after its Slurm node (`transom.launcher`), and, on the first live nodes to
register (3, or --controllers: transom.control.candidacy), one controller candidate each; the
controller makes the first `--nnodes` nodes to join members and the rest spares. Only the first
node keeps the job's status.json, events.jsonl and progress.jsonl and prints its events
(`Launch.mirror`); the others follow the job record alone.

Files (RUN_DIR, default ./transom-runs/slurm-<job>, must be on a file system every node shares):
    RUN_DIR/checkpoints/          default --ckpt-storage: the same for every step and requeue
    RUN_DIR/<job id>/store.json   the first node's etcd: URL (its TLS files next to it)
    RUN_DIR/<job id>/<node>/      that node's launcher: logs/ (the first node's: status.json,
                                  events.jsonl, progress.jsonl too)
where <job id> is `Allocation.job_id` (slurm-<job>.<step>[-r<requeues>]).

Signals: Slurm sends the time limit's warning (`--signal=USR1@T`) and scancel's SIGTERM to every
process of the step. Only the launcher acts on SIGUSR1 (its children ignore it, `env.IGNORE_USR1`);
on either signal it stops the job's processes on its node and exits `EXIT_STOPPED`: storage
holds the newest checkpoint persisted, and a requeue or re-submission resumes from it. A job that
failed because too few nodes were left exits `EXIT_STOPPED` too: a requeue brings new nodes.

With `drain_evicted`, a watcher drains every node the controller evicts (`slurm.drain`), once per
job (the first launcher to claim it in etcd), and records it, or why it could not, as an event.
This module must never kill a process it did not start or drain a node the controller did not
evict.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from rich.console import Console

from transom.checkpoint import storage
from transom.checkpoint.shm_dirs import default_shm_dir
from transom.cluster import slurm
from transom.common import env, files, keys
from transom.common.names import BadId
from transom.common.records import Event, EventKind, JobRecord, RecordError
from transom.common.states import JobState
from transom.control.tick import REASON_NOT_ENOUGH_NODES
from transom.job_spec import ConfigError, JobSpec, prepare_run_dir
from transom.launcher import Launch, Launcher
from transom.store import EmbeddedEtcd, Store, StoreAccess, StoreError
from transom.store.key_follow import KeyFollower
from transom.store.tls import CA_FILE, CLIENT_CERT_FILE, CLIENT_KEY_FILE

log = logging.getLogger("transom.slurm")

# `transom run` in a Slurm step stopped before the job's end (the time limit's signal, scancel,
# too few nodes left): the newest persisted checkpoint is in storage; requeue or re-submit.
EXIT_STOPPED = 75  # EX_TEMPFAIL
EXIT_INTERRUPTED = 130  # what the launcher returns when a signal stopped it
RENDEZVOUS_TIMEOUT_S = 300.0  # how long a node waits for the first node's etcd
RENDEZVOUS_POLL_S = 0.2
DRAIN_POLL_S = 1.0  # how often the drain watcher looks at `stopped` (and retries etcd)
# The first node keeps etcd up this long at most after the job's end, until the other nodes'
# agents have gone, so their launchers see the end instead of a vanished etcd.
LINGER_S = 20.0


def run_args(
    allocation: slurm.Allocation, spec: JobSpec, store: StoreAccess | None, args, runs: Path
) -> int:
    """`run` with the options of `transom run` (args); `runs` holds the default run directory."""
    from transom.utils.net import host_address

    if args.refill_spares:
        raise ConfigError("--refill-spares starts simulated nodes; Slurm gives this job its nodes")
    if args.local_nodes not in (None, 1):
        raise ConfigError("--local-nodes: one node agent per Slurm node (srun one task per node)")
    if not args.mirror:
        raise ConfigError("--no-mirror: under Slurm the first node mirrors the job")
    return run(
        allocation,
        spec,
        store,
        prepare_run_dir(args.run_dir or runs / f"{slurm.JOB_PREFIX}{allocation.job}"),
        args.host or host_address(),
        node_id=args.node_id,
        controllers=args.controllers,
        drain_evicted=args.slurm_drain,
        fresh=args.fresh,
        discard_storage=args.discard_storage,
    )


def attempt_dir(run_dir: Path, allocation: slurm.Allocation) -> Path:
    return run_dir / allocation.job_id


def run(
    allocation: slurm.Allocation,
    spec: JobSpec,
    store: StoreAccess | None,
    run_dir: Path,
    host: str,
    node_id: str | None = None,
    controllers: int | None = None,
    drain_evicted: bool = False,
    fresh: bool = False,
    discard_storage: bool = False,
) -> int:
    """Run this node's part of the job; the exit code of `transom run` (EXIT_STOPPED when a
    signal stopped it)."""
    node = node_id or allocation.node
    if spec.ckpt_storage is None:
        spec.ckpt_storage = str(run_dir / files.CHECKPOINTS)
    here = prepare_run_dir(attempt_dir(run_dir, allocation))
    node_dir = prepare_run_dir(here / node)
    etcd = None
    if store is None:
        if allocation.is_first:
            etcd = start_store(here, host, spec)
            store = etcd.access
        else:
            store = wait_store(here, spec.job_id, allocation.first)
    launch = Launch(
        spec=spec,
        run_dir=node_dir,
        store=store,
        local_nodes=1,
        controllers=controllers,
        node_prefix=node,
        host=host,
        mirror=allocation.is_first,
        fresh=fresh,
        discard_storage=fresh and discard_storage,
    )
    stopped = threading.Event()
    watcher = None
    if drain_evicted:
        watcher = DrainWatcher(Store(store, spec.job_id), node, stopped)
        watcher.start()
    os.environ[env.IGNORE_USR1] = "1"  # for the processes the launcher starts

    def time_limit(signum, frame):
        log.warning("Slurm's time-limit signal: stopping this node's part of the job")
        raise KeyboardInterrupt

    signal.signal(signal.SIGUSR1, time_limit)
    code = EXIT_INTERRUPTED
    # One node shows the job's events on the step's output (srun merges every task's).
    console = None if allocation.is_first else Console(quiet=True)
    try:
        code = Launcher(launch, console).run()
    except KeyboardInterrupt:  # a second signal while the launcher was stopping its processes
        code = EXIT_INTERRUPTED
    finally:
        # Stopping: Slurm's next signals (srun forwards scancel's again) must not cut it short.
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(s, signal.SIG_IGN)
        stopped.set()
        # Stopped while stopping, the launcher may have left its node's checkpoint memory behind.
        shutil.rmtree(default_shm_dir(spec.job_id, node), ignore_errors=True)
        if watcher is not None:
            watcher.join(timeout=5.0)
        if etcd is not None:
            if code != EXIT_INTERRUPTED:  # the job ended: the other nodes should see it end
                _linger(Store(store, spec.job_id))
            etcd.stop()
    if code == EXIT_INTERRUPTED or ran_out_of_nodes(node_dir):
        newest = storage.complete_steps(Path(spec.ckpt_storage))
        print(
            f"transom: {node}: the job stopped before its end; exit {EXIT_STOPPED}: requeue or "
            f"re-submit to resume from the newest checkpoint in {spec.ckpt_storage} "
            f"({f'step {newest[0]}' if newest else 'none yet'})",
            file=sys.stderr,
        )
        return EXIT_STOPPED
    return code


def ran_out_of_nodes(node_dir: Path) -> bool:
    """The job (per the launcher's last status.json) failed because too few nodes were left:
    new nodes, from a requeue, let it go on."""
    try:
        snap = json.loads((node_dir / files.STATUS).read_text())
        job = JobRecord.from_dict(snap.get("job"))
    except (OSError, ValueError, AttributeError, RecordError):
        return False
    return job.state is JobState.FAILED and job.reason.startswith(REASON_NOT_ENOUGH_NODES)


def start_store(here: Path, host: str, spec: JobSpec) -> EmbeddedEtcd:
    """The first node: start the job's etcd on `host`, and tell the other nodes where it is."""
    rendezvous = here / files.STORE_RENDEZVOUS
    rendezvous.unlink(missing_ok=True)
    etcd = EmbeddedEtcd(
        here / files.ETCD,
        log_path=files.log_file(here, "etcd"),
        tls_dir=here / files.ETCD_TLS,
        host=host,
    ).start()
    try:
        tmp = rendezvous.with_name(f".{rendezvous.name}.tmp")
        tmp.write_text(json.dumps({"job_id": spec.job_id, "url": etcd.url}))
        os.replace(tmp, rendezvous)
    except BaseException:
        etcd.stop()
        raise
    return etcd


def wait_store(here: Path, job_id: str, first: str) -> StoreAccess:
    """Every other node: the first node's etcd, once its `store.json` names this job."""
    rendezvous = here / files.STORE_RENDEZVOUS
    tls = here / files.ETCD_TLS
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            found = json.loads(rendezvous.read_text())
        except (OSError, ValueError):
            found = None
        if isinstance(found, dict) and found.get("job_id") == job_id:
            url = found.get("url")
            if not isinstance(url, str):
                raise ConfigError(f"{rendezvous}: no etcd URL in it")
            try:
                return StoreAccess(
                    url, tls / CA_FILE, tls / CLIENT_CERT_FILE, tls / CLIENT_KEY_FILE
                )
            except StoreError as e:
                raise ConfigError(f"{rendezvous}: {e}") from None
        time.sleep(RENDEZVOUS_POLL_S)
    raise ConfigError(
        f"the job's first node {first} did not start etcd within {RENDEZVOUS_TIMEOUT_S:.0f} s "
        f"(no {rendezvous}; is the run directory on a file system every node shares?)"
    )


def _linger(store: Store) -> None:
    """Keep etcd up until every agent of the job has deregistered (or LINGER_S passed)."""
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        try:
            if not store.get_prefix(keys.NODES):
                break
        except StoreError:
            break
        time.sleep(RENDEZVOUS_POLL_S)
    time.sleep(2 * RENDEZVOUS_POLL_S + 0.5)  # their launchers poll the job record twice a second


class DrainWatcher(threading.Thread):
    """Drains (`slurm.drain`) every node the controller evicts, once per job, and says so in an
    event; a drain Slurm refuses is an event too, never a failure of the job."""

    def __init__(self, store: Store, me: str, stopped: threading.Event):
        super().__init__(name="slurm-drain", daemon=True)
        self.store, self.me, self.stopped = store, me, stopped
        self.seen: set[str] = set()

    def run(self) -> None:
        # The job record, pushed by a watch (it changes a few times a job): no steady request
        # on any node (it was read every second on each).
        follower = KeyFollower(self.store, keys.JOB)
        try:
            while not self.stopped.is_set():
                try:
                    now = time.monotonic()
                    follower.start_once(now)
                    self.drain_new(follower.refresh(now))
                except StoreError as e:  # etcd unreachable for now: the next round tries again
                    log.info("drain watcher: %s", e)
                    self.stopped.wait(DRAIN_POLL_S)
                follower.wait(DRAIN_POLL_S)
        finally:
            follower.stop()

    def drain_new(self, value: object) -> None:
        """Drain the evicted nodes of job record `value` not seen yet."""
        try:
            job = JobRecord.from_dict(value or {})
        except RecordError:
            return
        for node, eviction in sorted(job.evicted.items()):
            if node in self.seen:
                continue
            self.seen.add(node)
            if not self.store.create(keys.slurm_drained(node), {"by": self.me}):
                continue  # another node's launcher drains it
            try:
                slurm.drain(node, eviction.reason)
                kind, message = EventKind.DECISION, f"slurm: drained {node} (--slurm-drain)"
            except (slurm.SlurmError, BadId) as e:
                kind, message = EventKind.WARNING, f"slurm: could not drain {node}: {e}"
            event = Event(time.time(), kind, message, node=node, extra={"reason": eviction.reason})
            self.store.put(keys.event(event.time, f"slurm-{self.me}"), event.to_dict())
            log.info("%s", message)
