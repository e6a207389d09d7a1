"""Transom: keeps PyTorch training jobs running through failures.

Subpackages:
  control   the launcher, node agents and the controller (the paper's TOL)
  monitor   signals from workers and nodes (the paper's TEE)
  store     the etcd control plane: client wrapper and an embedded etcd for one machine
"""

__version__ = "0.1.0"
