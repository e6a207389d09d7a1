"""The generation's torch store (c10d TCPStore), hosted in a process of its own on the master node.

Every rank of a generation is a client of one store (TORCHELASTIC_USE_AGENT_STORE, as torchrun's
agent hosts it): hosted by rank 0, it would die with rank 0 before the other ranks are done with
it, and listen on every interface (TCPStore takes no address). The store needs torch, which the
agent never imports (1.1 s of CPU in the master node's agent, beside the start-up of the whole
node on the critical path, and again on the node that becomes the master after an eviction).
So the agent only makes the store's socket, and a host process serves it:

- `TorchStore` (the agent's side): a TCP socket bound to the node's address and listening before
  the address is published, so the port cannot be taken in between and ranks that connect early
  wait in its backlog; `start` launches the host, forked from the node's warm interpreter (torch
  already imported: about 20 ms) or started cold, and hands it the socket over a Unix socket in
  a private directory (SCM_RIGHTS), to that process only (its pid, checked with SO_PEERCRED).
  The connection stays open: the host serves until the agent closes it (`close`, at the
  generation's end) or dies. A host that does not take the socket in HANDOFF_WAIT_S gets none,
  and the socket is closed: the ranks fail now instead of at their timeout.
- `main` (the host's side, this file run as a script by the worker bootstrap or
  `python -m transom.control.store_host`): takes the socket, serves the store on it, exits when
  the link closes.

It never serves anything but the store, and never outlives the agent (the host dies with its
interpreter or, started cold, with the agent: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from transom.common import env as env_names
from transom.control.warm import ForkedWorker, WarmPool
from transom.utils.net import listening_socket
from transom.utils.procs import new_session_dying_with_parent

log = logging.getLogger("transom.workers")

# Where the host finds the agent's end of the handoff (a Unix socket's path).
HANDOFF = "TRANSOM_TORCH_STORE_HANDOFF"
# How long the agent waits for the host to take the socket: a cold host imports torch first.
HANDOFF_WAIT_S = 60.0
# How long `close` waits for the host to exit once killed (its interpreter reports the exit).
EXIT_WAIT_S = 1.0
SCRIPT = str(Path(__file__).resolve())


class TorchStore:
    """The agent's side: the store's socket, its host process, and the link between them."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._socket: socket.socket | None = listening_socket(host)
        self.port: int = self._socket.getsockname()[1]
        self._dir = Path(tempfile.mkdtemp(prefix="transom-store-"))  # mode 0700
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self._dir / "handoff.sock"))
        self._listener.listen(1)
        self._link: socket.socket | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.proc: subprocess.Popen[bytes] | ForkedWorker | None = None

    def start(self, pool: WarmPool | None, log_path: Path) -> None:
        """Launch the host (from `pool`'s warm interpreter where it has one, else cold) and hand
        it the socket from a thread. Call from the agent's main thread (PDEATHSIG follows the
        forking thread)."""
        environ = {
            **os.environ,
            HANDOFF: str(self._dir / "handoff.sock"),
            env_names.AUTO_MONITOR: "0",  # no training to instrument
        }
        log_path.parent.mkdir(parents=True, exist_ok=True)
        proc: subprocess.Popen[bytes] | ForkedWorker | None = None
        if pool is not None:
            proc = pool.launch([SCRIPT], environ, log_path)
        if proc is None:
            with open(log_path, "ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-u", "-m", "transom.control.store_host"],
                    env=environ,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=new_session_dying_with_parent,
                )
        self.proc = proc
        handover = threading.Thread(target=self._hand_over, args=(proc.pid,), daemon=True)
        handover.start()

    def _hand_over(self, pid: int) -> None:
        self._listener.settimeout(HANDOFF_WAIT_S)
        try:
            while True:
                conn, _ = self._listener.accept()
                sender, uid, _gid = struct.unpack(
                    "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                )
                if (sender, uid) == (pid, os.getuid()):
                    break
                conn.close()  # not our host: it gets nothing
        except OSError as e:  # closed, or no host in time
            with self._lock:
                if not self._closed:
                    log.warning("the torch store's host did not start: %s", e)
                self._close_socket()  # the ranks' connections fail now
            return
        with self._lock:
            if self._closed or self._socket is None:
                conn.close()
                return
            try:
                socket.send_fds(conn, [b"S"], [self._socket.fileno()])
                self._link = conn
            except OSError as e:
                log.warning("cannot hand the torch store's socket to its host: %s", e)
                conn.close()
            self._close_socket()  # the host's copy is the store's; ours must not queue ranks

    def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def close(self) -> None:
        """Stop the store: its socket, the link (the host exits) and the host itself."""
        with self._lock:
            self._closed = True
            self._close_socket()
            for s in (self._link, self._listener):
                if s is not None:
                    s.close()
            self._link = None
        with contextlib.suppress(OSError):
            (self._dir / "handoff.sock").unlink(missing_ok=True)
            self._dir.rmdir()
        if self.proc is not None:
            self.proc.kill()
            try:
                self.proc.wait(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                pass  # reaped later by its interpreter (or dies with it)


def main() -> int:
    """The host: take the socket from the agent, serve the store on it until the link closes."""
    link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    link.connect(os.environ[HANDOFF])
    _message, fds, _flags, _addr = socket.recv_fds(link, 16, 1)
    if len(fds) != 1:
        print("transom torch store: the agent sent no socket", file=sys.stderr)
        return 1
    listener = socket.socket(fileno=fds[0])
    host, port = listener.getsockname()[:2]
    fd = listener.detach()  # the store owns the descriptor from here on

    from torch.distributed import TCPStore

    store = TCPStore(
        host, port, is_master=True, wait_for_workers=False, master_listen_fd=fd, use_libuv=True
    )
    while link.recv(64):  # until the agent closes the link, or dies
        pass
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
