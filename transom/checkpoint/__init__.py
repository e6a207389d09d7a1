"""Transom's checkpoint engine (the paper's TCE): saves that block only for a memory copy.

Shards live in a per-node server's shared memory, are replicated to a peer node and persisted
to storage in the background, listed in etcd, and loaded back from the fastest tier holding a
good copy. Tiers are named by `transom.common.states.Tier` (memory, peer, storage).
  engine.py          the worker's API (`Engine`); save_handle.py a save in progress (`SaveHandle`)
    agreement.py     without a controller, every rank loads the same step, or none
    next_region.py   the next save's region, mapped before that save
  single_file.py     `save`/`load`: a torch.save / torch.load pair in the shard format
    client.py        its requests to the node's server, each with a time limit
    pinning.py       CUDA registration of the regions it copies GPU tensors into
  tiers.py           where the loader reads from (memory, peer, storage): `LoadTier`s, in order
  server.py          the per-node server, wiring:
    server_options.py  its configuration and command line (`ServerConfig`, `default_budget`)
    budget.py        its memory: shards, region pool, budget, eviction
    pipeline.py      the save pipeline: checksums, replication, persistence (background)
    worker_service.py / peer_service.py   its Unix-socket and TCP request handling
    peer_port.py     its TCP port: handshakes in one selector, a thread per authenticated peer
    publisher.py     its etcd side: lease, catalog listings, events, the plan it follows
    agent_lease.py   the node agent's lease, handed to the server on its stdin
  catalog.py         the shard catalog in etcd; replication.py, protocol.py the wire
  storage.py, shm.py, shm_dirs.py   files, shared memory
  storage_claim.py   a job's hold on its storage directory; what a rerun resumes from
  shard_format.py    the shard format's bytes: header, checksums (all the server needs of it)
  shard_header.py    the shard header's typed record (`ShardHeader`, `Timeline`), read validated
  layout.py          a state as a shard's tensor table and data, and back (workers: torch)
The names below are imported on first use, so that the parts that need no torch (the checkpoint
server, the catalog, the shared-memory directories) can be imported by node agents, the launcher
and the server's process without it.
"""

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "engine",
    "SaveHandle": "save_handle",
    "CheckpointError": "engine",
    "SaveRefused": "save_handle",
    "save": "single_file",
    "load": "single_file",
    "ShardError": "shard_format",
    "UnsupportedValue": "layout",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'transom.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"transom.checkpoint.{_EXPORTS[name]}"), name)
