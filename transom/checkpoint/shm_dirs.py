"""Where each node's checkpoint server keeps its shared memory, and freeing what dead servers left.

Imports nothing heavy (no torch), so node agents and the launcher can use it cheaply.
"""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

SHM_ROOT = Path("/dev/shm")
# A server's socket file older than this that refuses connections belongs to a dead server.
STALE_SOCKET_AGE_S = 60.0


def default_shm_dir(job_id: str, node_id: str) -> Path:
    return SHM_ROOT / f"transom-{job_id[:32]}-{node_id[:32]}"


def sweep_stale_shm(root: Path = SHM_ROOT) -> list[Path]:
    """Remove the shared memory of checkpoint servers that died without cleaning up (their whole
    process tree was SIGKILLed, e.g. with the launcher): shared memory outlives processes, and
    nobody else would ever free it. A directory counts as dead when its server socket is more
    than STALE_SOCKET_AGE_S old and refuses connections. Returns the directories removed."""
    removed = []
    for sock_path in root.glob("transom-*/server.sock"):
        try:
            if time.time() - sock_path.stat().st_mtime < STALE_SOCKET_AGE_S:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(str(sock_path))
            continue  # a live server
        except (ConnectionRefusedError, FileNotFoundError):
            pass
        except OSError:
            continue
        shutil.rmtree(sock_path.parent, ignore_errors=True)
        removed.append(sock_path.parent)
    return removed
