"""The control plane: a thin etcd client (`Store`), how to reach etcd (`StoreAccess`: URL and
TLS files), and an embedded etcd with per-run certificates.

Everything the controller needs to resume after its own crash lives in etcd; checkpoint data
and per-step monitoring samples never do.
"""

from transom.store.access import StoreAccess, StoreError
from transom.store.embedded import EmbeddedEtcd
from transom.store.etcd_client import Store

__all__ = ["Store", "StoreAccess", "StoreError", "EmbeddedEtcd"]
