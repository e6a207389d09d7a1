"""Pre-flight link test: latency and bandwidth between a joining node and its peers.

Warm-up measures each node's compute (transom.control.preflight); this measures the network.
Every agent runs a `LinkServer`, a small TCP service on its node's address, published under
`links/<node>` with the node's lease. When a node joins (before generation 1, or as a spare that
may later replace a member) it measures the links to up to LINK_PEERS of the live peers that
publish one (those after it in name order, so each node serves about as many tests), waiting
at most LINK_WAIT_S for the peers it expects: per peer the median round trip of LINK_PINGS
one-byte pings and the best of LINK_TRIES timed LINK_BYTES transfers. Its
score is its *best* link (the highest bandwidth, the lowest latency): a node with a bad link is
slow to every peer, while a good node has at least one good link even when a bad peer is among
its peers. The controller compares the scores (`link_outliers`, through policy.slow_outliers) and
excludes a node far below its peers' median, like a node slow to compute, before it costs a
restart; the scores are in the node's pre-flight result (`preflight/<node>`), so in the
exclusion's `evict` event, the report and `transom status`.

The test is bounded (LINK_WAIT_S for peers to appear, LINK_IO_TIMEOUT_S per operation, a few MiB
per peer) and a peer that cannot be reached is left out, never a failure: a failed link test
only means no link score. The server trusts nothing it reads: a request is one known byte and a
length at most LINK_MAX_BYTES, each connection is bounded in time, and it never answers with
more than one byte. `delay_s` (the `slow_link` test fault) delays each of this node's sends and
each chunk its server receives, as a bad link would.

This module must never decide about a node: it measures and reports; the policy decides.
"""

from __future__ import annotations

import logging
import socket
import statistics
import struct
import threading
import time
from typing import TYPE_CHECKING

from transom.common import keys
from transom.common.names import natural_key
from transom.common.records import LinkAddress, LinkMeasure, PreflightResult, parse_all

if TYPE_CHECKING:
    from transom.store import Store
    from transom.store.etcd_client import Lease

LINK_PEERS = 4  # peers measured at most (the test stays short however large the job)
LINK_PINGS = 10
LINK_BYTES = 1 << 20
LINK_TRIES = 3
LINK_CHUNK = 64 << 10
LINK_MAX_BYTES = 4 << 20
LINK_WAIT_S = 10.0
LINK_IO_TIMEOUT_S = 5.0
LINK_CONNECTIONS = 16  # concurrent connections the server serves at most
# A node is excluded when its best link's bandwidth is below LINK_SLOW_RATIO x the nodes' median,
# or its best latency above LINK_LATENCY_RATIO x the median and LINK_LATENCY_FLOOR_MS more.
LINK_SLOW_RATIO = 0.05  # 20x: a shared machine measured 0.16x on a healthy loopback link
LINK_LATENCY_RATIO = 5.0
LINK_LATENCY_FLOOR_MS = 10.0  # scheduling delays of a busy machine stay below
LINK_MIN_NODES = 3  # with two nodes one slow link is both nodes': no one to blame
PING, BULK, ACK = b"P", b"B", b"A"
_LENGTH = struct.Struct("!I")

log = logging.getLogger("transom.links")


def _send(sock: socket.socket, data: bytes, delay_s: float) -> None:
    if delay_s > 0:
        time.sleep(delay_s)
    sock.sendall(data)


def _recv_exactly(sock: socket.socket, n: int, delay_s: float = 0.0) -> bytes:
    """`n` bytes; with `delay_s` (a slow link) each chunk of LINK_CHUNK waits that long first."""
    parts, left = [], n
    while left:
        if delay_s > 0:
            time.sleep(delay_s)
        part = _recv_chunk(sock, min(left, LINK_CHUNK))
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _recv_chunk(sock: socket.socket, n: int) -> bytes:
    """Up to `n` bytes, all of them unless the peer is slow; ConnectionError when closed."""
    part = sock.recv(n, socket.MSG_WAITALL)
    if not part:
        raise ConnectionError("closed")
    return part


class LinkServer:
    """Answers pings and timed transfers of peers' link tests (see the module docstring)."""

    def __init__(self, host: str, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(0.5)
        self.address = (host, self.sock.getsockname()[1])
        self._slots = threading.BoundedSemaphore(LINK_CONNECTIONS)
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name="link-server", daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()  # too many at once: the peer's test leaves this link out
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + LINK_WAIT_S + LINK_IO_TIMEOUT_S * 4
        try:
            conn.settimeout(LINK_IO_TIMEOUT_S)
            while time.monotonic() < deadline:
                kind = conn.recv(1)
                if kind == PING:
                    _send(conn, PING, self.delay_s)
                elif kind == BULK:
                    (n,) = _LENGTH.unpack(_recv_exactly(conn, _LENGTH.size))
                    if n > LINK_MAX_BYTES:
                        return
                    _recv_exactly(conn, n, self.delay_s)
                    _send(conn, ACK, self.delay_s)
                else:
                    return  # closed, or not a request
        except (OSError, ConnectionError, struct.error):
            return
        finally:
            conn.close()
            self._slots.release()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


def measure(address: tuple[str, int], delay_s: float = 0.0) -> LinkMeasure | None:
    """The link to one peer's LinkServer; None if it cannot be reached."""
    try:
        with socket.create_connection(address, timeout=LINK_IO_TIMEOUT_S) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rtts = []
            for _ in range(LINK_PINGS):
                t0 = time.perf_counter()
                _send(sock, PING, delay_s)
                if _recv_exactly(sock, 1) != PING:
                    return None
                rtts.append(time.perf_counter() - t0)
            payload = bytes(LINK_CHUNK)
            best = 0.0
            for _ in range(LINK_TRIES):
                t0 = time.perf_counter()
                _send(sock, BULK + _LENGTH.pack(LINK_BYTES), 0.0)
                for _ in range(LINK_BYTES // LINK_CHUNK):
                    _send(sock, payload, delay_s)
                if _recv_exactly(sock, 1) != ACK:
                    return None
                best = max(best, LINK_BYTES / (time.perf_counter() - t0) / 1e6)
    except (OSError, ConnectionError):
        return None
    return LinkMeasure(round(statistics.median(rtts) * 1000, 3), round(best, 1))


def publish(store: Store, node_id: str, server: LinkServer, lease: Lease | None = None) -> None:
    host, port = server.address
    store.put(keys.link(node_id), LinkAddress(host, port).to_dict(), lease=lease)


def peers(store: Store, node_id: str) -> dict[str, tuple[str, int]]:
    """Live peers (registered nodes) that publish a link server, by name; bad entries left out."""
    live = set(store.get_prefix(keys.NODES))
    return {
        node: (a.host, a.port)
        for node, a in parse_all(LinkAddress, store.get_prefix(keys.LINKS)).items()
        if node != node_id and node in live and 0 < a.port < 65536
    }


def neighbours(node_id: str, peers: list[str]) -> list[str]:
    """Up to LINK_PEERS peers that follow `node_id` in name order, wrapping around: every node is
    tested by about LINK_PEERS others, however large the job (not all by the same first few)."""
    ring = sorted({*peers, node_id}, key=natural_key)
    at = ring.index(node_id)
    return [n for n in ring[at + 1 :] + ring[:at]][:LINK_PEERS]


def link_test(
    store: Store, node_id: str, expected_peers: int, delay_s: float = 0.0
) -> dict[str, LinkMeasure]:
    """This node's links to the peers it tested, by peer (`with_links` makes them its pre-flight
    evidence): none when there is no peer to test, or none could be reached."""
    if expected_peers <= 0:
        return {}
    deadline = time.monotonic() + LINK_WAIT_S
    found = peers(store, node_id)
    while len(found) < min(expected_peers, LINK_PEERS) and time.monotonic() < deadline:
        time.sleep(0.2)
        found = peers(store, node_id)
    chosen = neighbours(node_id, list(found))
    return {n: m for n in chosen if (m := measure(found[n], delay_s)) is not None}


def with_links(result: PreflightResult, links: dict[str, LinkMeasure]) -> PreflightResult:
    """`result` with the links a node measured, and its score: its best link's bandwidth and
    latency."""
    result.links = dict(links)
    if links:
        result.link_mbps = max(m.mbps for m in links.values())
        result.link_latency_ms = min(m.latency_ms for m in links.values())
    return result


def _measured_by_peers(results: dict[str, PreflightResult], node: str, field: str) -> list[float]:
    """What the other nodes measured of their link to `node` (`field`: mbps or latency_ms); a
    value that is not a positive number is left out (the evidence comes from etcd)."""
    found = []
    for other, result in results.items():
        link = result.links.get(node) if other != node else None
        value = getattr(link, field) if link is not None else 0.0
        if value > 0:
            found.append(value)
    return found


def link_outliers(results: dict[str, PreflightResult]) -> dict[str, str]:
    """Nodes whose best link is far worse than the nodes' median -> why to exclude them.

    `results`: node -> its pre-flight result (link_mbps, link_latency_ms where measured, and
    `links`, what it measured of each peer). A node's own score can be low for a moment that is
    not its link's fault (its test ran while its machine was busy): when a peer measured a good
    link to it (not slow by the same rule), the node is not blamed."""
    bandwidth = {n: r.link_mbps for n, r in results.items() if r.link_mbps and r.link_mbps > 0}
    latency = {
        n: r.link_latency_ms
        for n, r in results.items()
        if r.link_latency_ms and r.link_latency_ms > 0
    }
    out: dict[str, str] = {}
    if len(bandwidth) >= LINK_MIN_NODES:
        median = statistics.median(bandwidth.values())
        for n, mbps in bandwidth.items():
            seen = _measured_by_peers(results, n, "mbps")
            if mbps < LINK_SLOW_RATIO * median and not any(
                m >= LINK_SLOW_RATIO * median for m in seen
            ):
                out[n] = (
                    f"pre-flight link test: best link {mbps:.1f} MB/s is {mbps / median:.2f}x its "
                    f"peers' median {median:.1f} MB/s (below {LINK_SLOW_RATIO}x)"
                )
    if len(latency) >= LINK_MIN_NODES:
        median = statistics.median(latency.values())
        limit = LINK_LATENCY_RATIO * median + LINK_LATENCY_FLOOR_MS
        for n, ms in latency.items():
            seen = _measured_by_peers(results, n, "latency_ms")
            if n not in out and ms > limit and not any(m <= limit for m in seen):
                out[n] = (
                    f"pre-flight link test: best latency {ms:.2f} ms against its peers' median "
                    f"{median:.2f} ms (above {LINK_LATENCY_RATIO}x + {LINK_LATENCY_FLOOR_MS} ms)"
                )
    return out
