"""Where each checkpoint server keeps its shared memory, who owns it, and freeing dead ones' memory.

A server's folder is /dev/shm/transom-<readable part>-<hash>: the hash (SHM_HASH_CHARS hex
characters of SHA-256) is taken over the FULL job and node ids, so two jobs whose names share a
long prefix (`pretrain-llama3-8b-2026-11-30-run-01` and `-02`) never share a folder or a socket;
the readable part (truncated ids) is only for people looking at /dev/shm.

Every folder holds an owner file (OWNER_FILE: pid, the process's start time, job, node) written
by the process that created it. A folder is dead when its owner process is gone (a pid reused by
another process does not count: the start time differs) and nothing accepts on its socket;
`sweep_stale_shm` removes dead folders only, whichever job they belong to, never a live one.
Folders of earlier releases (no owner file) are dead when their socket is older than
STALE_SOCKET_AGE_S and refuses connections. Imports nothing heavy (no torch), so node agents
and the launcher can use it cheaply. This module never removes a folder whose owner is alive.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from transom.common.record_base import Record

SHM_ROOT = Path("/dev/shm")
PREFIX = "transom-"
OWNER_FILE = "owner.json"
SOCKET_NAME = "server.sock"
SHM_HASH_CHARS = 16
# Characters of each id kept readable in a folder name (the hash makes the name unique).
READABLE_CHARS = 12
# A server's socket file older than this that refuses connections belongs to a dead server.
STALE_SOCKET_AGE_S = 60.0
# How long `claim` waits for a live owner of the folder to exit before refusing to take it.
CLAIM_WAIT_S = 5.0


def shm_key(job_id: str, node_id: str) -> str:
    """A short name unique to (job, node): the hash of both full ids."""
    digest = hashlib.sha256(f"{job_id}\0{node_id}".encode()).hexdigest()
    return digest[:SHM_HASH_CHARS]


def _readable(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:READABLE_CHARS]


def default_shm_dir(job_id: str, node_id: str) -> Path:
    """The shared-memory folder of job `job_id`'s server on node `node_id`."""
    return SHM_ROOT / f"{PREFIX}{_readable(job_id)}-{_readable(node_id)}-{shm_key(job_id, node_id)}"


def _start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


@dataclass(frozen=True)
class Owner(Record):
    """The process that owns a folder (its OWNER_FILE): pid and start time, its job and node."""

    pid: int
    start: float | None = None  # the process's start time (None: unknown)
    job: str = ""
    node: str = ""


def write_owner(directory: Path, job_id: str = "", node_id: str = "") -> None:
    """Record this process as the owner of `directory` (atomically: a temporary file renamed)."""
    pid = os.getpid()
    owner = Owner(pid, _start_time(pid), job_id, node_id)
    tmp = directory / f".{OWNER_FILE}.tmp"
    tmp.write_text(json.dumps(owner.to_dict()))
    os.replace(tmp, directory / OWNER_FILE)


def read_owner(directory: Path) -> Owner | None:
    """The owner record of `directory`; None when it has none or it is not a valid one (another
    process's file: it is checked, not trusted)."""
    try:
        return Owner.from_dict(json.loads((Path(directory) / OWNER_FILE).read_text()))
    except (OSError, ValueError, RecursionError):  # RecordError is a ValueError
        return None


def owner_alive(owner: Owner) -> bool:
    """Whether the process an owner record names still runs (the same process, not a reused pid)."""
    started = _start_time(owner.pid)
    if started is None:
        return False
    return owner.start is None or abs(started - owner.start) < 1.0


def _socket_answers(sock_path: Path) -> bool:
    """Whether something accepts connections on `sock_path` (unsure counts as yes)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            probe.connect(str(sock_path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # busy or unreadable: not proof of death


def is_dead(directory: Path) -> bool:
    """Whether `directory` (a server's folder) belongs to nobody alive."""
    owner = read_owner(directory)
    sock_path = Path(directory) / SOCKET_NAME
    if owner is not None:
        return not owner_alive(owner) and not _socket_answers(sock_path)
    try:  # a folder of an earlier release: judged by its socket alone
        age = time.time() - sock_path.stat().st_mtime
    except FileNotFoundError:
        return False  # no owner, no socket: not a server's folder (or one still starting)
    return age >= STALE_SOCKET_AGE_S and not _socket_answers(sock_path)


def sweep_stale_shm(root: Path = SHM_ROOT) -> list[Path]:
    """Remove the shared memory of checkpoint servers and in-process engines that died without
    cleaning up (SIGKILL): shared memory outlives processes, and nobody else would free it.
    Folders of live owners are kept, whichever job they belong to. Returns the folders removed."""
    removed = []
    for directory in sorted(Path(root).glob(f"{PREFIX}*")):
        if not directory.is_dir() or directory.is_symlink():
            continue
        if is_dead(directory):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


class OwnedBySomeoneElse(OSError):
    """A shared-memory folder another live process owns."""


def claim(directory: Path, job_id: str = "", node_id: str = "") -> None:
    """Make `directory` an empty folder owned by this process: a dead owner's leftovers are
    removed; OwnedBySomeoneElse when a live process owns it (never take a live server's memory)."""
    directory = Path(directory)
    if directory.exists():
        owner = read_owner(directory)
        deadline = time.monotonic() + CLAIM_WAIT_S  # a previous owner may be exiting right now
        while (
            owner is not None
            and owner.pid != os.getpid()
            and owner_alive(owner)
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        if owner is not None and owner.pid != os.getpid() and owner_alive(owner):
            raise OwnedBySomeoneElse(
                f"{directory} belongs to a running process (pid {owner.pid}, job "
                f"{owner.job!r}, node {owner.node!r}); not taking it over"
            )
        shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, mode=0o700)
    write_owner(directory, job_id, node_id)
