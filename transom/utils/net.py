"""Networking helpers: free ports and this host's address."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    return "127.0.0.1"
