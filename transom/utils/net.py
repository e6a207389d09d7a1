"""Networking helpers: where a node's ports listen, free ports, this host's address.

`bind_address` is the one rule for where every port of a node listens (the checkpoint server's
peer port, the torch master store, gloo, the controller's metrics endpoint): loopback when the
job's etcd is on loopback (then every node of the job is on this machine), else the address the
node was given. Nothing of a job ever listens on a wildcard address (0.0.0.0, ::). This module
never opens a port for anything but asking the OS (free_port, listening_socket).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlparse

LOOPBACK = "127.0.0.1"
WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})


def is_loopback(host: str | None) -> bool:
    """Whether `host` (an address or "localhost") is this machine's loopback."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_address(store_url: str, host: str) -> str:
    """The address every port of a node of this job listens on.

    `store_url` is the job's etcd; `host` the address the node was given (what other nodes reach
    it at). A store on loopback means a single-machine job: 127.0.0.1. Otherwise `host`.
    ValueError for a wildcard host: a node's address is also what peers connect to, and no
    port of a job may listen on every interface."""
    if host.strip("[]") in WILDCARDS:
        raise ValueError(
            f"host {host!r} is a wildcard address: give the address other nodes reach this one at"
        )
    if is_loopback(urlparse(store_url).hostname) or is_loopback(host):
        return LOOPBACK
    return host


def interface_of(host: str) -> str | None:
    """The name of the network interface that carries `host`'s address (for gloo's
    GLOO_SOCKET_IFNAME), or None when no interface of this machine has it (e.g. behind NAT)."""
    import psutil

    if is_loopback(host):
        address = LOOPBACK
    else:
        try:
            address = str(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])
        except (OSError, IndexError):
            return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening_socket(host: str, backlog: int = 128) -> socket.socket:
    """A TCP socket bound to `host` on a port the OS picks, already listening: connections
    queue in its backlog until whoever takes the socket over accepts them."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host.strip("[]"), 0))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def host_address() -> str:
    """The address other machines reach this one at: the first non-loopback IPv4, else 127.0.0.1."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent by a UDP connect
            address = s.getsockname()[0]
            if address and not address.startswith("0."):
                return address
    except OSError:
        pass
    return LOOPBACK
