"""Transom's checkpoint engine (the paper's TCE): saves that block only for a memory copy.

Shards live in a per-node server's shared memory (server.py), are replicated to a peer node
(replication.py), persisted to storage in the background (storage.py), listed in etcd
(catalog.py) and loaded back from the fastest tier holding a good copy (engine.py). The shard
format is in layout.py; `save`/`load` are a torch.save/torch.load-style pair on that format.
"""

from transom.checkpoint.engine import CheckpointError, Engine, SaveHandle, SaveRefused, load, save
from transom.checkpoint.layout import ShardError, UnsupportedValue

__all__ = ["Engine", "SaveHandle", "CheckpointError", "SaveRefused", "ShardError", "UnsupportedValue",
           "save", "load"]
