"""A new job resumes from checkpoints an earlier job persisted: list them in its etcd catalog.

A requeued or re-submitted Slurm job is a new Transom job with a new, empty etcd, so its
controller would find no checkpoint and start fresh. `adopt_storage` lists every complete step
of the storage directory (a manifest, written once every rank's shard was there) in the new
job's catalog as held by the storage tier; the controller's restore step is then the newest of
them, exactly as if this job had persisted it. It must run before any controller plans a
generation (before the job spec is published). It only reads the storage directory: it never
writes, moves or deletes a checkpoint file.
"""

from __future__ import annotations

from pathlib import Path

from transom.checkpoint import catalog, storage
from transom.common.states import Tier
from transom.store import Store

ADOPTED_NODE = "storage"  # the catalog's `node` of an adopted shard: no node wrote it in this job


def adopt_storage(store: Store, root: Path) -> list[int]:
    """List the complete steps under `root` in `store`'s catalog; returns them, newest first.
    A step whose manifest does not parse, or lacks a rank's shard file, is skipped."""
    adopted = []
    for step in storage.complete_steps(root):
        manifest = storage.read_manifest(root, step)
        if not isinstance(manifest, dict):
            continue
        world_size = manifest.get("world_size")
        if not isinstance(world_size, int) or world_size < 1:
            continue
        paths = [storage.shard_path(root, step, rank) for rank in range(world_size)]
        if not all(p.is_file() for p in paths):
            continue
        for rank, path in enumerate(paths):
            info = {
                "world_size": world_size,
                "node": ADOPTED_NODE,
                "tier": Tier.STORAGE,
                "path": str(path),
                "nbytes": path.stat().st_size,
            }
            catalog.publish(store, step, rank, catalog.STORAGE_HOLDER, info)
        adopted.append(step)
    return adopted
