"""Worker-side progress reports, sent to the node agent as UDP datagrams on loopback.

A worker calls `report(step, loss=..., tokens=...)` once a step. The call must never block
and never raise into training: without an agent (TRANSOM_MONITOR_PORT unset) it does nothing,
and a lost datagram only means one sample fewer. The agent keeps the newest step per rank.
"""

from __future__ import annotations

import json
import os
import socket
import time

MONITOR_PORT_ENV = "TRANSOM_MONITOR_PORT"

_sock: socket.socket | None = None
_addr: tuple[str, int] | None = None


def _target() -> tuple[str, int] | None:
    global _sock, _addr
    if _addr is None:
        port = os.environ.get(MONITOR_PORT_ENV)
        if not port:
            return None
        _addr = ("127.0.0.1", int(port))
        _sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        _sock.setblocking(False)
    return _addr


def report(step: int, **metrics: float) -> None:
    """Tell the node agent that this rank finished `step`, with optional scalar metrics."""
    try:
        addr = _target()
        if addr is None or _sock is None:
            return
        message = {"rank": int(os.environ.get("RANK", -1)), "step": int(step), "time": time.time()}
        message.update({k: float(v) for k, v in metrics.items()})
        _sock.sendto(json.dumps(message).encode(), addr)
    except Exception:  # noqa: BLE001 - monitoring must never break training
        pass
