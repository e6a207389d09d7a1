"""The pre-flight link test (transom.control.links): real TCP on loopback, a dict for etcd."""

from __future__ import annotations

import socket

import pytest

from transom.common import keys
from transom.common.records import LinkMeasure, PreflightResult, parse_all
from transom.control import links
from transom.control.policy import slow_outliers

HOST = "127.0.0.1"
DELAY_S = 0.005  # what `slow_link@node=N:factor=5` adds to each send


class DictStore:
    def __init__(self) -> None:
        self.data: dict[str, object] = {}

    def put(self, key: str, value, lease=None) -> None:
        self.data[key] = value

    def get_prefix(self, prefix: str) -> dict:
        return {k[len(prefix) :]: v for k, v in self.data.items() if k.startswith(prefix)}


@pytest.fixture
def servers():
    made: list[links.LinkServer] = []

    def make(delay_s: float = 0.0) -> links.LinkServer:
        made.append(links.LinkServer(HOST, delay_s))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_link_is_measured_and_a_slow_one_shows(servers):
    fast = links.measure(servers().address)
    slow = links.measure(servers(DELAY_S).address)
    assert fast is not None and slow is not None
    assert slow.latency_ms >= DELAY_S * 1000 > fast.latency_ms
    assert fast.mbps > 5 * slow.mbps


def test_a_node_with_a_slow_link_is_excluded_and_no_other(servers):
    store = DictStore()
    delays = {"node0": 0.0, "node1": 0.0, "node2": DELAY_S, "node3": 0.0}
    for node, delay in delays.items():
        store.put(keys.node(node), {})
        links.publish(store, node, servers(delay))
    results = {
        node: links.with_links(
            PreflightResult(passed=True, compute_gflops=10.0),
            links.link_test(store, node, 3, delay),
        )
        for node, delay in delays.items()
    }
    assert set(results["node0"].links) == {"node1", "node2", "node3"}
    # What etcd holds reads back the same.
    assert {n: PreflightResult.from_dict(r.to_dict()) for n, r in results.items()} == results
    excluded = slow_outliers(results)
    assert list(excluded) == ["node2"] and "pre-flight link test" in excluded["node2"]


def _results(scores: dict[str, dict]) -> dict[str, PreflightResult]:
    """Pre-flight results as the controller reads them from etcd (`parse_all`: a value that is
    not a valid record is left out)."""
    return parse_all(PreflightResult, {n: {"passed": True, **s} for n, s in scores.items()})


def test_two_nodes_cannot_tell_whose_link_is_slow():
    scores = {"a": {"link_mbps": 1000.0}, "b": {"link_mbps": 10.0}}
    assert links.link_outliers(_results(scores)) == {}
    scores["c"] = {"link_mbps": 900.0, "link_latency_ms": 0.1}
    assert list(links.link_outliers(_results(scores))) == ["b"]
    latency = {n: {"link_latency_ms": ms} for n, ms in {"a": 0.1, "b": 0.2, "c": 25.0}.items()}
    assert list(links.link_outliers(_results(latency))) == ["c"]
    even = {n: {"link_latency_ms": 0.1 * (i + 1)} for i, n in enumerate("abc")}
    assert links.link_outliers(_results(even)) == {}


def test_a_node_whose_peers_measured_a_good_link_to_it_is_not_blamed_for_its_own_busy_test():
    # b's own test ran while its machine was busy (88 MB/s against a median of 2,165 MB/s), but
    # a measured its link to b at full speed: b's link is fine, b stays.
    scores = {
        "a": {"link_mbps": 2165.0, "links": {"b": {"mbps": 2100.0, "latency_ms": 0.1}}},
        "b": {"link_mbps": 88.0, "link_latency_ms": 30.0},
        "c": {"link_mbps": 2200.0, "link_latency_ms": 0.1},
        "d": {"link_mbps": 2100.0, "link_latency_ms": 0.1},
    }
    assert links.link_outliers(_results(scores)) == {}
    # What a peer saw of a bad link corroborates it; forged entries are not evidence: a bad
    # entry is left out (c's other entries count), a bad table costs its whole record (d's).
    scores["a"]["links"]["b"] = {"mbps": 20.0, "latency_ms": 40.0}
    scores["c"]["links"] = {
        "b": {"mbps": "fast", "latency_ms": -1},
        "a": None,
        "d": {"mbps": 2000.0, "latency_ms": 0.2},
    }
    scores["d"]["links"] = ["b"]
    results = _results(scores)
    assert set(results) == {"a", "b", "c"} and list(results["c"].links) == ["d"]
    assert list(links.link_outliers(results)) == ["b"]
    # A peer's negative or zero measurement is no evidence either.
    results["c"].links["b"] = LinkMeasure(latency_ms=-1.0, mbps=0.0)
    assert list(links.link_outliers(results)) == ["b"]


def test_no_peer_no_test_and_gone_or_bogus_peers_are_left_out(servers):
    store = DictStore()
    assert links.link_test(store, "node0", 0) == {}
    store.put(keys.node("node0"), {})
    store.put(keys.node("node1"), {})
    store.put(keys.node("node2"), {})
    gone = servers()
    links.publish(store, "node1", gone)
    gone.close()
    store.put(keys.link("node2"), {"host": HOST, "port": "not a port"})
    store.put(keys.link("node9"), {"host": HOST, "port": 1})  # not a live node
    assert links.link_test(store, "node0", 1) == {}


def test_the_server_drops_bad_requests_and_serves_on(servers):
    server = servers()
    for junk in (b"X", links.BULK + links._LENGTH.pack(links.LINK_MAX_BYTES + 1)):
        with socket.create_connection(server.address, timeout=2) as sock:
            sock.sendall(junk)
            assert sock.recv(1) == b""  # closed without an answer
    assert links.measure(server.address) is not None


def test_each_node_tests_the_peers_after_it_so_no_node_serves_them_all():
    names = [f"node{i}" for i in range(10)]
    chosen = {n: links.neighbours(n, [p for p in names if p != n]) for n in names}
    assert chosen["node8"] == ["node9", "node0", "node1", "node2"]
    served = [sum(n in peers for peers in chosen.values()) for n in names]
    assert served == [links.LINK_PEERS] * len(names)
    assert links.neighbours("node0", ["node1"]) == ["node1"]
