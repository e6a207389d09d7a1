"""Transom's checkpoint engine (the paper's TCE): saves that block only for a memory copy.

Shards live in a per-node server's shared memory (server.py), are replicated to a peer node
(replication.py), persisted to storage in the background (storage.py), listed in etcd
(catalog.py) and loaded back from the fastest tier holding a good copy (engine.py). The shard
format is in layout.py; `save`/`load` are a torch.save/torch.load-style pair on that format.
The names below are imported on first use, so that the parts that need no torch (the catalog,
the shared-memory directories) can be imported by node agents and the launcher without it.
"""

import importlib

_EXPORTS = {
    "Engine": "engine",
    "SaveHandle": "engine",
    "CheckpointError": "engine",
    "SaveRefused": "engine",
    "save": "engine",
    "load": "engine",
    "ShardError": "layout",
    "UnsupportedValue": "layout",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'transom.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"transom.checkpoint.{_EXPORTS[name]}"), name)
