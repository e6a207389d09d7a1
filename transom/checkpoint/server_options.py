"""A checkpoint server's configuration, defined once: the dataclass, its command line, its sizes.

`ServerConfig` is what a `CheckpointServer` runs with. Each field's metadata names its option
of `transom ckpt-server` (`python -m transom.checkpoint.server`) and its help, so the parser
(`build_parser`), the reader of parsed options (`from_args`) and the argv a node agent builds
(`to_argv`) are all generated from the fields and cannot drift from them. `default_budget` is
defined here and nowhere else (`parse_size`: transom.common.sizes). How the server reaches etcd
(`--store` and its TLS files) is a `StoreAccess` (`store_access`), the same options as every
other Transom command's. The peer port's address (`--host`) is never a wildcard: the server
listens only where peers are told to connect. It must never start anything.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from transom.checkpoint.shm_dirs import default_shm_dir
from transom.common import env
from transom.common.sizes import parse_size
from transom.store.access import FLAG_CA, FLAG_CERT, FLAG_KEY, FLAG_URL, StoreAccess, StoreError
from transom.utils.net import LOOPBACK, WILDCARDS

# Complete steps per rank kept in memory: two, so that after a fault every rank still holds
# the newest step all ranks finished (a rank that died saving step S+1 holds S; the others,
# which saved S+1, still hold S) and the ring peer's replica may lag a step. With the region of
# the save in progress, a node holds at most three times its share of the state, plus replicas.
DEFAULT_MEMORY_KEEP = 2
DEFAULT_STORAGE_KEEP = 3
SOCKET_NAME = "server.sock"

# On SIGTERM (a scheduler's stop, the time limit's signal) a server with storage first waits this
# long for the shards its workers saved to reach storage, so the newest step outlives the node;
# the agent gives it this much more than its usual grace (schedulers give 30 s).
PERSIST_ON_STOP_S = 15.0


def default_budget() -> int:
    """Half of this machine's memory, or of the container's where a cgroup limits it."""
    from transom.utils.memory_limit import usable_memory

    return usable_memory() // 2


def _size_option(text: str) -> int:
    """`parse_size` for argparse: its message, not argparse's generic one, on a bad size."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _option(flag: str, help: str, default: Any = MISSING, **argparse_kw: Any) -> Any:
    """A field that is the command-line option `flag` (argparse keywords: type, choices, ...)."""
    meta = {"flag": flag, "help": help, **argparse_kw}
    return field(default=default, metadata=meta)


@dataclass
class ServerConfig:
    node_id: str = _option("--node-id", "this node's name (default: the host name)")
    socket_path: Path = _option(
        "--socket", "Unix socket for this node's workers (default: in --shm-dir)", type=Path
    )
    shm_dir: Path = _option(
        "--shm-dir",
        "folder for shared-memory regions (default /dev/shm/transom-JOB-NODE)",
        type=Path,
    )
    budget_bytes: int = _option(
        "--memory",
        "memory budget, e.g. 16G (default: half of this machine's memory)",
        type=_size_option,
    )
    storage_dir: Path | None = _option(
        "--storage", "storage directory for persisted shards (default: none)", None, type=Path
    )
    memory_keep: int = _option(
        "--memory-keep", "steps per rank kept in memory", DEFAULT_MEMORY_KEEP, type=int
    )
    storage_keep: int = _option(
        "--keep", "complete steps kept in storage", DEFAULT_STORAGE_KEEP, type=int
    )
    replicas: int = _option(
        "--replicas", "replicas in peer memory (0 or 1)", 1, type=int, choices=(0, 1)
    )
    # The peer port listens on this address and nowhere else (a wildcard is refused).
    host: str = _option(
        "--host",
        "address peers reach this server at; its peer port listens there only "
        "(default 127.0.0.1: peers on this machine only)",
        LOOPBACK,
    )
    port: int = _option("--port", "TCP port for peers (default: any free port)", 0, type=int)
    # Not an option: peers authenticate with it, so it comes from the environment (CKPT_SECRET).
    secret: bytes = b""
    store_url: str | None = _option(FLAG_URL, "etcd URL of the job (catalog, peers, events)", None)
    store_ca: Path | None = _option(FLAG_CA, "CA certificate of etcd's server", None, type=Path)
    store_cert: Path | None = _option(FLAG_CERT, "client certificate for etcd", None, type=Path)
    store_key: Path | None = _option(FLAG_KEY, "client key for etcd", None, type=Path)
    job_id: str = _option("--job-id", "job name in etcd", "local")
    lease_ttl_s: int = _option(
        "--lease-ttl", "seconds this server's etcd entries outlive it (--lease own)", 4, type=int
    )
    # Run by a node agent: its etcd entries live under the agent's lease (agent_lease.py).
    lease: str = _option(
        "--lease",
        "own: hold a lease of its own (--lease-ttl); agent: list under the lease its parent "
        "node agent writes on its stdin, one lease id a line, and hold none (default own)",
        "own",
        choices=("own", "agent"),
    )
    # A node agent restarting a dead server sets it: what that one listed lives under the same
    # lease, and the new server's memory starts empty.
    withdraw_stale: int = _option(
        "--withdraw-stale",
        "1: withdraw the memory listings a dead server of this node left in the catalog, "
        "before listing any (the node agent sets it when it restarts one; default 0)",
        0,
        type=int,
        choices=(0, 1),
    )
    # With it (and --store), the server fetches its ranks' shards of the plan's restore step from
    # the peers holding them as soon as the plan names it (prefetch.py), ahead of the workers.
    ranks_per_node: int = _option(
        "--ranks-per-node",
        "worker ranks per node (the node at position i of the plan's members runs ranks "
        "i*N .. i*N+N-1): with --store its ranks' shards of the plan's restore step are fetched "
        "from peers into this server's memory ahead of its workers (default 0: no prefetch)",
        0,
        type=int,
    )
    # A fixed peer "host:port" for replicas, instead of the plan's ring.
    peer: str | None = _option(
        "--peer",
        "send replicas to this server (default with --store: the next node in the plan's ring)",
        None,
        metavar="HOST:PORT",
    )

    def store_access(self) -> StoreAccess | None:
        """How this server reaches etcd; None without --store."""
        if self.store_url is None:
            return None
        return StoreAccess(self.store_url, self.store_ca, self.store_cert, self.store_key)


def _options() -> list[tuple[str, dict[str, Any]]]:
    """(field name, its option metadata) of every field that is a command-line option."""
    return [(f.name, dict(f.metadata)) for f in fields(ServerConfig) if "flag" in f.metadata]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="transom ckpt-server",
        description="Run a node's checkpoint server (the node agent starts one per node).",
    )
    for name, meta in _options():
        flag = meta.pop("flag")
        p.add_argument(flag, dest=name, default=None, **meta)
    p.add_argument("--log-level", default="info")
    return p


def from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServerConfig:
    """The configuration of parsed options: unset ones take the field's default, or the derived
    default (node id: host name; shm dir: per job and node; socket: in it; budget: half the
    memory). The secret comes from the environment. ValueError when it is missing but needed."""
    environ = dict(os.environ) if environ is None else environ
    given = {name: getattr(args, name) for name, _ in _options()}
    values = {k: v for k, v in given.items() if v is not None}
    values.setdefault("node_id", socket.gethostname())
    values.setdefault("job_id", ServerConfig.job_id)
    values.setdefault("shm_dir", default_shm_dir(values["job_id"], values["node_id"]))
    values.setdefault("socket_path", values["shm_dir"] / SOCKET_NAME)
    if "budget_bytes" not in values:
        values["budget_bytes"] = default_budget()
    if values.get("host", LOOPBACK).strip("[]") in WILDCARDS:
        raise ValueError(
            f"--host {values['host']!r}: give the address peers reach this server at; "
            "it never listens on every interface"
        )
    if values.get("ranks_per_node", 0) < 0:
        raise ValueError(f"--ranks-per-node {values['ranks_per_node']}: 0 or more")
    if values.get("lease") == "agent" and not values.get("store_url"):
        raise ValueError(f"--lease agent needs {FLAG_URL}")
    networked = bool(values.get("store_url") or values.get("peer"))
    values["secret"] = environ.get(env.CKPT_SECRET, "").encode()
    if networked and not values["secret"]:
        raise ValueError(
            f"{env.CKPT_SECRET} must be set with --store or --peer (peers authenticate with it)"
        )
    if not networked:
        values["replicas"] = 0
    cfg = ServerConfig(**values)
    try:
        if cfg.store_url is None and (cfg.store_ca or cfg.store_cert or cfg.store_key):
            raise StoreError(f"the etcd certificate options need {FLAG_URL}")
        cfg.store_access()  # checks the URL and the files now
    except StoreError as e:
        raise ValueError(str(e)) from None
    return cfg


def store_options(access: StoreAccess) -> dict[str, Any]:
    """The `to_argv` fields that give a server this access to etcd."""
    return {
        "store_url": access.url,
        "store_ca": access.ca,
        "store_cert": access.cert,
        "store_key": access.key,
    }


def to_argv(**values: Any) -> list[str]:
    """The options for `python -m transom.checkpoint.server` that set these fields (by field
    name; None values are left out). KeyError for a name that is not an option."""
    flags = {name: meta["flag"] for name, meta in _options()}
    argv = []
    for name, value in values.items():
        if name not in flags:
            raise KeyError(f"{name!r} is not a checkpoint server option")
        if value is not None:
            argv += [flags[name], str(value)]
    return argv
