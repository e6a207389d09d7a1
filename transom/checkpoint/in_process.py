"""The checkpoint server an `Engine` starts inside its own process when no launcher gave it one.

Without `transom run` there is no node agent to start a server: the engine starts one in its
process, with memory and storage tiers and no peer (nothing to replicate to), in a shared-memory
folder of its own (named EMBEDDED_PREFIX, the pid and a random suffix); folders of dead
processes are swept first. This module only builds and starts that server; the engine owns it
(drains and stops it on `close`, frees it at exit).
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from transom.checkpoint.server import CheckpointServer
from transom.checkpoint.server_options import SOCKET_NAME, ServerConfig, default_budget
from transom.checkpoint.shm_dirs import SHM_ROOT, sweep_stale_shm

log = logging.getLogger("transom.ckpt")

EMBEDDED_PREFIX = "transom-local-"


def start_server(
    storage_dir: Path, job_id: str, memory_bytes: int | None, keep: int | None
) -> CheckpointServer:
    """A started server for this process alone, persisting to `storage_dir`."""
    for stale in sweep_stale_shm():
        log.info("removed the shared memory of a dead checkpoint process: %s", stale)
    shm_dir = SHM_ROOT / f"{EMBEDDED_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    cfg = ServerConfig(
        node_id=f"local-{os.getpid()}",
        socket_path=shm_dir / SOCKET_NAME,
        shm_dir=shm_dir,
        budget_bytes=memory_bytes or default_budget(),
        storage_dir=storage_dir,
        replicas=0,
        storage_keep=keep or ServerConfig.storage_keep,
        job_id=job_id,
    )
    return CheckpointServer(cfg).start()
