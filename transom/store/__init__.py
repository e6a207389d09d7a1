"""The control plane: a thin etcd client (`Store`), the job's key layout, and an embedded etcd.

Everything the controller needs to resume after its own crash lives in etcd; checkpoint data
and per-step monitoring samples never do.
"""

from transom.store.client import Store, StoreError
from transom.store.embedded import EmbeddedEtcd

__all__ = ["Store", "StoreError", "EmbeddedEtcd"]
