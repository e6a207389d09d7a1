"""The node agent's lease, handed to its checkpoint server: one lease a node, not two.

A node agent's checkpoint server is its child and dies with it (transom.control.ckpt_node), so
the server's etcd entries (its peer address, the shards its memory holds) can live exactly as
long as the node's registration: under the agent's lease. The server then renews no lease of its
own, which saves etcd one request a node a second on a small job's 4 s lease. The agent writes
each lease it takes (the first, and a new one after an outage let the old expire) to the
server's stdin, one decimal lease id a line (`line`); the server reads them (`follow`) and lists
everything again under the newest (checkpoint/publisher.py). The pipe is private to the two
processes, and still each line is checked (`parse`): a line that is not a lease id is logged and
ignored, never acted on.

This module only encodes, checks and reads lease ids; it never talks to etcd.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import BinaryIO

log = logging.getLogger("transom.ckpt.server")

# etcd's lease ids are positive int64s; a line longer than this is not one.
MAX_LEASE_ID = 2**63 - 1
MAX_LINE = 32


def line(lease_id: int) -> bytes:
    """What the agent writes for `lease_id`."""
    return b"%d\n" % lease_id


def parse(raw: bytes) -> int | None:
    """The lease id of one line, None when the line is not a valid one."""
    text = raw.strip()
    if not text.isdigit() or len(text) > MAX_LINE:
        return None
    lease_id = int(text)
    return lease_id if 0 < lease_id <= MAX_LEASE_ID else None


def follow(stream: BinaryIO, adopt: Callable[[int], None]) -> threading.Thread:
    """Read lease ids from `stream` until it ends (the agent gone), calling `adopt` with each
    valid one, in a daemon thread (returned, started)."""

    def read() -> None:
        overlong = False  # within a line longer than MAX_LINE: skipped to its end
        for raw in iter(lambda: stream.readline(MAX_LINE + 2), b""):
            whole = raw.endswith(b"\n")
            if overlong or not whole:
                if not overlong:
                    log.warning("ignored an overlong line from the node agent: %r...", raw)
                overlong = not whole
                continue
            lease_id = parse(raw)
            if lease_id is None:
                log.warning("ignored a line from the node agent that is not a lease id: %r", raw)
            else:
                adopt(lease_id)
        log.info("the node agent's lease pipe closed")

    thread = threading.Thread(target=read, name="ckpt-agent-lease", daemon=True)
    thread.start()
    return thread
