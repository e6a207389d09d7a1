"""The node agent's checkpoint server: started with the agent, restarted if it dies, gone with it.

The server is a child process of the agent (it dies with the agent, as the node's memory would),
configured from the job spec; its etcd entries live under the agent's lease, which the agent
writes to its stdin (transom.checkpoint.agent_lease: the node renews one lease, not two), and a
server started in place of a dead one withdraws what that one listed under it. The agent hands
its workers the variables the checkpoint engine reads (socket, secret, storage directory). The
job's checkpoint secret lives in etcd (`ckpt/secret`): the first agent creates it, every other
one reads the same. This module never touches checkpoint data.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from transom.checkpoint import agent_lease
from transom.checkpoint.server_options import PERSIST_ON_STOP_S, SOCKET_NAME, store_options, to_argv
from transom.checkpoint.shm_dirs import default_shm_dir, sweep_stale_shm
from transom.common import env, files, keys
from transom.job_spec import JobSpec
from transom.store import Store
from transom.utils.procs import die_with_parent, stop_process

log = logging.getLogger("transom.agent")

# A server not serving by then is reported (and waited for as long as it lives: start-up is
# slow on a loaded machine, and slow is not dead).
START_TIMEOUT_S = 30.0
# Launches of a server that exits before it serves, before the agent's start-up gives up.
START_ATTEMPTS = 3
# Once running, a server that died is started again at most this often (not waited for).
RESTART_INTERVAL_S = 2.0


class NodeCheckpointServer:
    def __init__(self, spec: JobSpec, store: Store, node_id: str, run_dir: Path, host: str):
        self.spec = spec
        self.store = store
        self.node_id = node_id
        self.run_dir = Path(run_dir)
        self.host = host
        self.shm_dir = default_shm_dir(spec.job_id, node_id)
        self.socket_path = self.shm_dir / SOCKET_NAME
        self.storage_dir = (
            Path(spec.ckpt_storage) if spec.ckpt_storage else self.run_dir / files.CHECKPOINTS
        )
        self.process: subprocess.Popen[bytes] | None = None
        self.serving = False  # the current process answered on its socket
        self.launched_at = -RESTART_INTERVAL_S  # monotonic time of the newest launch
        self.secret = ""
        self.lease_id: int | None = None  # the agent's lease, handed to every server it starts

    def start_patiently(self, stopping: threading.Event | None = None) -> None:
        """`start`, launched again (START_ATTEMPTS in all) when the server exits before it
        serves; RuntimeError when the last one did too."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self.start(stopping)
                return
            except RuntimeError as e:
                if (stopping is not None and stopping.is_set()) or attempt == START_ATTEMPTS:
                    raise
                log.warning("%s (attempt %d of %d); starting it again", e, attempt, START_ATTEMPTS)

    def launch(self) -> None:
        """Start the server process unless one runs, and return at once: the agent registers
        and runs its pre-flight while the server starts, then waits for it (`start_patiently`)."""
        if self.process is None or self.process.poll() is not None:
            self._launch()

    def start(self, stopping: threading.Event | None = None) -> None:
        """Start the server (unless one `launch`ed runs) and wait until it serves, for as long
        as it lives (a warning after START_TIMEOUT_S) or until `stopping`. Call from the
        agent's main thread."""
        self.launch()
        log_path = self._log_path()
        assert self.process is not None
        started = time.monotonic()
        warned = False
        while not self._serving():
            if self.process.poll() is not None or (stopping is not None and stopping.is_set()):
                self.stop()
                raise RuntimeError(
                    f"checkpoint server of {self.node_id} did not start; see {log_path}"
                )
            if not warned and time.monotonic() - started > START_TIMEOUT_S:
                warned = True
                log.warning(
                    "checkpoint server of %s not serving after %.0f s; still waiting (see %s)",
                    self.node_id,
                    START_TIMEOUT_S,
                    log_path,
                )
            time.sleep(0.05)
        self.serving = True
        log.info("checkpoint server of %s serving at %s", self.node_id, self.socket_path)

    def _log_path(self) -> Path:
        return files.log_file(self.run_dir, f"ckpt-server-{self.node_id}")

    def _launch(self) -> None:
        """Start a server process (not waiting for it)."""
        for stale in sweep_stale_shm():
            log.warning("removed the shared memory of a dead checkpoint server: %s", stale)
        if not self.secret:  # read once: a restart needs no etcd
            self.store.create(keys.CKPT_SECRET, secrets.token_hex(32))
            secret = self.store.get(keys.CKPT_SECRET)
            if not isinstance(secret, str) or not secret:
                raise RuntimeError(f"the job's checkpoint secret ({keys.CKPT_SECRET}) is bad")
            self.secret = secret
        argv = [sys.executable, "-m", "transom.checkpoint.server"] + to_argv(
            node_id=self.node_id,
            job_id=self.spec.job_id,
            **store_options(self.store.access),
            host=self.host,
            shm_dir=self.shm_dir,
            socket_path=self.socket_path,
            storage_dir=self.storage_dir,
            storage_keep=self.spec.ckpt_keep,
            replicas=self.spec.ckpt_replicas,
            lease="agent",
            withdraw_stale=int(self.process is not None),  # a dead server's listings live on
            budget_bytes=self.spec.ckpt_memory_bytes or None,  # None: the server's default
            ranks_per_node=self.spec.nproc_per_node,  # its ranks' restore shards are prefetched
        )
        log_path = self._log_path()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.process is not None:
            _close_stdin(self.process)  # the dead server's end of the lease pipe
        with open(log_path, "ab") as out:
            self.process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE,
                env={**os.environ, env.CKPT_SECRET: self.secret},
                preexec_fn=die_with_parent,
            )
        self._hand_lease()
        self.serving = False
        self.launched_at = time.monotonic()

    def use_lease(self, lease_id: int) -> None:
        """The agent's new lease: the server lists under it (and every server started later)."""
        self.lease_id = lease_id
        self._hand_lease()

    def _hand_lease(self) -> None:
        """Write the agent's lease to the running server (one that died gets it when started)."""
        process = self.process
        if self.lease_id is None or process is None or process.stdin is None:
            return
        try:
            process.stdin.write(agent_lease.line(self.lease_id))
            process.stdin.flush()
        except OSError as e:  # the server died: its successor is handed the lease
            log.warning("cannot hand the node's lease to its checkpoint server: %s", e)

    def _serving(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(str(self.socket_path))
                return True
            except OSError:
                return False

    def ensure_running(self) -> None:
        """One agent tick's look at the server, never waiting for it (the agent's loop goes
        on): start a new one if it died (its shards are gone; peers and storage still have
        copies) or was never started again: at once when it had served, else at most every
        RESTART_INTERVAL_S (one that dies at start-up is started again, never given up: a node
        must not go on without its server for the rest of the job); note when a new one
        serves. Saves on this node are refused until then (the engine says why)."""
        now = time.monotonic()
        if self.process is not None and self.process.poll() is None:
            if not self.serving and self._serving():
                self.serving = True
                log.info("checkpoint server of %s serving again", self.node_id)
            return
        if not self.serving and now - self.launched_at < RESTART_INTERVAL_S:
            return  # it died before it served (or never started): no faster than this
        if self.process is None:
            log.warning("checkpoint server of %s is not running; starting it", self.node_id)
        else:
            log.warning(
                "checkpoint server of %s exited (%s) %s; starting it again",
                self.node_id,
                self.process.returncode,
                "while serving" if self.serving else "before it served",
            )
        self._launch()

    def worker_env(self) -> dict[str, str]:
        return {
            env.CKPT_SOCKET: str(self.socket_path),
            env.CKPT_SECRET: self.secret,
            env.CHECKPOINT_DIR: str(self.storage_dir),
        }

    def stop(self) -> None:
        """SIGTERM the server (it persists what its workers saved, then frees its shared memory),
        SIGKILL it after a grace, and remove what it left in /dev/shm."""
        if self.process is not None:
            stop_process(self.process, grace_s=PERSIST_ON_STOP_S + 3)
            _close_stdin(self.process)
            self.process = None
        shutil.rmtree(self.shm_dir, ignore_errors=True)


def _close_stdin(process: subprocess.Popen[bytes]) -> None:
    if process.stdin is not None:
        try:
            process.stdin.close()
        except OSError:  # a write to a dead reader that was still buffered
            pass
