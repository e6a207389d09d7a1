"""The monitor channel's socket: a Unix datagram socket that only the agent's user can write to.

The agent binds `monitor.sock` in a directory of its own, created by `tempfile.mkdtemp` (mode
0700, owned by the agent's user, a fresh random name after `dir_prefix`: a hash of the job's run
directory and the node id) under the temporary directory; workers get
the socket's path in the environment (transom.common.env.MONITOR_SOCKET) and send datagrams to
it (transom.monitor.reporter). Another local user cannot search the directory, so cannot reach
the socket. The kernel also hands the listener each sender's credentials (SO_PASSCRED), and a
datagram from another uid is refused: a second check should the directory ever be opened up.

An agent killed outright leaves its directory behind: each new channel removes this user's
directories whose socket is gone or refuses connections (`sweep_stale`).

A process of the same user can write to the socket. That is out of scope: such a process can
ptrace the workers, read their memory and environment, and signal them anyway.

This module must never interpret a datagram (that is transom.monitor.datagram) and `receive`
must never raise but to say the socket was closed (OSError).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import stat
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from transom.monitor.datagram import MAX_BYTES

SOCKET_NAME = "monitor.sock"
DIR_PREFIX = "transom-mon-"
PATH_LIMIT = 100  # sun_path holds 108 bytes on Linux, 104 on macOS; keep a margin
FALLBACK_TMP = "/tmp"
RECEIVE_TIMEOUT_S = 0.5
STALE_AFTER_S = 60.0  # a younger directory may belong to an agent that is binding its socket
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_PASSCRED = getattr(socket, "SO_PASSCRED", None)  # Linux only
_CREDENTIALS = getattr(socket, "SCM_CREDENTIALS", None)


@dataclass(frozen=True)
class Received:
    """One datagram off the socket: its bytes, whether it was cut (too long), the sender's uid."""

    data: bytes
    truncated: bool
    uid: int | None  # None where the platform does not pass credentials; -1 if they were missing


def dir_prefix(scope: str, node_id: str) -> str:
    """The start of the name of a node's socket directory (`scope`: the job's run directory)."""
    digest = hashlib.sha256(scope.encode() + b"\0" + node_id.encode()).hexdigest()
    return f"{DIR_PREFIX}{digest[:12]}-"


def private_dir(scope: str, node_id: str) -> Path:
    """A new directory of mode 0700 for one node's socket, under a temporary directory short
    enough for the socket path limit."""
    prefix = dir_prefix(scope, node_id)
    for base in (tempfile.gettempdir(), FALLBACK_TMP):
        # mkdtemp's random part is 8 characters; "/" + SOCKET_NAME follows.
        if len(os.fsencode(base)) + len(f"/{prefix}12345678/{SOCKET_NAME}") < PATH_LIMIT:
            sweep_stale(Path(base))
            path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
            check_private(path)
            return path
    raise OSError(f"no temporary directory short enough for a Unix socket path: {base}")


def sweep_stale(base: Path) -> list[Path]:
    """Remove this user's channel directories under `base` whose socket is gone or refuses
    connections (its agent died without closing it). Returns those removed; never raises."""
    removed = []
    for path in base.glob(f"{DIR_PREFIX}*"):
        try:
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
                continue
            if time.time() - info.st_mtime < STALE_AFTER_S:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
                probe.connect(str(path / SOCKET_NAME))  # sends nothing
            continue  # a live channel
        except (ConnectionRefusedError, FileNotFoundError):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except OSError:
            continue
    return removed


def check_private(path: Path) -> None:
    """Raise unless `path` is a real directory owned by this user that no one else may enter."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private directory of this user (mode 0700)")


class ChannelSocket:
    """The listening end: bound in a private directory; `close` removes both."""

    def __init__(self, node_id: str, scope: str = "") -> None:
        self.dir = private_dir(scope, node_id)
        self.path = self.dir / SOCKET_NAME
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            if _PASSCRED is not None:
                self.sock.setsockopt(socket.SOL_SOCKET, _PASSCRED, 1)
            self.sock.settimeout(RECEIVE_TIMEOUT_S)
        except OSError:
            self.close()
            raise
        self._ancillary = socket.CMSG_SPACE(_UCRED.size) if _PASSCRED is not None else 0

    def receive(self) -> Received | None:
        """The next datagram, or None after RECEIVE_TIMEOUT_S without one. OSError: closed."""
        try:
            data, ancillary, flags, _ = self.sock.recvmsg(MAX_BYTES + 1, self._ancillary)
        except TimeoutError:
            return None
        uid = None if _PASSCRED is None else -1
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == _CREDENTIALS and len(payload) >= _UCRED.size:
                uid = _UCRED.unpack_from(payload)[1]
        truncated = bool(flags & socket.MSG_TRUNC) or len(data) > MAX_BYTES
        return Received(data, truncated, uid)

    def close(self) -> None:
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)
