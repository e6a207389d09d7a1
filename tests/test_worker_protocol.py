"""The worker socket's requests and replies as records (worker_protocol.py): every request kind
round-trips through its wire message, a malformed request or reply is refused at the boundary,
and the catalog's memory copies are read from etcd's contents without trusting them."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from transom.checkpoint import catalog
from transom.checkpoint.client import CheckpointError, ServerConnection
from transom.checkpoint.protocol import MAX_SHARD_BYTES, recv_msg, send_msg
from transom.checkpoint.shard_header import ShardHeader, Timeline
from transom.checkpoint.worker_protocol import (
    PARSERS,
    Abort,
    Commit,
    Event,
    Failed,
    Held,
    Locate,
    Located,
    Persist,
    PrefetchStatus,
    Prepare,
    Reached,
    Region,
    Reserve,
    ShardStatus,
    Source,
    Status,
    StatusRequest,
    StepList,
    Steps,
    Wait,
    parse_request,
)
from transom.common import keys
from transom.common.states import Tier

HEADER = ShardHeader(3, 1, 2, 0, tree={"l": []}, timeline=Timeline("j", 1, 2))

EVERY_REQUEST = [
    Reserve(3, 1, 4096, 2),
    Reserve(3, 1, 4096, 2, generation=5),
    Commit(3, 1, HEADER.to_json()),
    Commit(3, 1, HEADER.to_json(), persist=False, tables=2),
    Abort(3, 1),
    Persist(3, 1),
    Wait(3, 1, Tier.PEER),
    Wait(3, 1, Tier.STORAGE, 2.5),
    Locate(3, 1),
    Prepare(4096),
    Prepare(4096, rank=7),
    Prepare(4096, rank=7, persist=False),
    Held(1, 2, 10),
    Held(1, 2, 10, before=20),
    Steps(4),
    Event("bad-copy", "rank 1 step 3: bad copy", {"corrupt": True, "step": 3}),
    StatusRequest(),
]


def test_every_request_kind_has_a_parser_and_round_trips_through_json() -> None:
    assert {type(r).op for r in EVERY_REQUEST} == set(PARSERS)
    for request in EVERY_REQUEST:
        assert parse_request(json.loads(json.dumps(request.to_msg()))) == request


@pytest.mark.parametrize(
    ("msg", "error"),
    [
        ({"op": "delete"}, "unknown request"),
        ({"step": 1}, "unknown request"),
        ({"op": ["reserve"]}, "unknown request"),
        ({"op": "reserve", "step": 1, "rank": 0, "nbytes": 8}, "world_size must be"),
        ({"op": "reserve", "step": -1, "rank": 0, "nbytes": 8, "world_size": 1}, "step must"),
        ({"op": "reserve", "step": True, "rank": 0, "nbytes": 8, "world_size": 1}, "step must"),
        (
            {"op": "reserve", "step": 1, "rank": 0, "nbytes": MAX_SHARD_BYTES + 1, "world_size": 1},
            "nbytes must",
        ),
        ({"op": "reserve", "step": 1, "rank": 0, "nbytes": 8, "world_size": 0}, "world_size"),
        (
            {"op": "reserve", "step": 1, "rank": 0, "nbytes": 8, "world_size": 1, "ahead": 1},
            "'ahead' must be true or false",
        ),
        (
            {
                "op": "reserve",
                "step": 1,
                "rank": 0,
                "nbytes": 8,
                "world_size": 1,
                "generation": "x",
            },
            "generation must",
        ),
        ({"op": "commit", "step": 1, "rank": 0, "header": []}, "header"),
        (
            {"op": "commit", "step": 3, "rank": 1, "header": HEADER.to_json(), "persist": 1},
            "persist must",
        ),
        ({"op": "wait", "step": 1, "rank": 0, "tier": "disk"}, "unknown tier"),
        ({"op": "wait", "step": 1, "rank": 0, "tier": "memory", "timeout": -1}, "timeout must"),
        ({"op": "wait", "step": 1, "rank": 0, "tier": "memory", "timeout": "1"}, "timeout must"),
        ({"op": "held", "rank": 0, "world_size": 1, "floor": 1.5}, "floor must"),
        ({"op": "event", "action": 3}, "action must be a string"),
        ({"op": "event", "fields": {"message": "x"}}, "fields are an object"),
        ({"op": "event", "fields": [1]}, "fields are an object"),
    ],
)
def test_a_malformed_request_is_refused_naming_what_is_wrong(
    msg: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        parse_request(msg)


def test_replies_are_read_as_the_record_their_request_expects() -> None:
    assert Reserve(1, 0, 8, 1).read_reply({"ok": True, "path": "/r", "nbytes": 8}) == Region(
        "/r", 8
    )
    assert Wait(1, 0, Tier.MEMORY).read_reply({"ok": True, "tiers": ["memory"]}) == Reached(
        ["memory"]
    )
    assert Steps(2).read_reply({"ok": True, "steps": [5, 3]}) == StepList([5, 3])
    sources = [
        {"tier": "memory", "node": "node0", "path": "/r", "header": HEADER.to_json()},
        {"tier": "peer", "addr": "10.0.0.2:7000"},
    ]
    assert Locate(1, 0).read_reply({"ok": True, "sources": sources}) == Located(
        [Source("memory", "node0", "/r", header=HEADER), Source("peer", addr="10.0.0.2:7000")]
    )
    status = StatusRequest().read_reply({"ok": True, "node": "n", "shards": []})
    assert status == Status("n")
    full = Status(
        "n",
        "10.0.0.1:7000",
        used=64,
        budget=128,
        free=[32],
        shards=[ShardStatus(3, 1, "committed", ["memory"], "local", {"storage": "disk full"})],
        prefetch=[PrefetchStatus(3, 0, "fetched", "n2", 0.5), PrefetchStatus(4, 0, "running")],
    )
    assert StatusRequest().read_reply(json.loads(json.dumps(full.to_msg()))) == full
    # A failure is a Failed whatever else it carries, and never raises.
    assert Reserve(1, 0, 8, 1).read_reply({"ok": False, "error": "full", "refused": True}) == (
        Failed("full", refused=True)
    )
    assert Wait(1, 0, Tier.PEER).read_reply({"ok": "yes", "timeout": True}).timeout is True
    assert Steps(1).read_reply({}) == Failed("no reason given")


@pytest.mark.parametrize(
    ("request_", "reply", "error"),
    [
        (Reserve(1, 0, 8, 1), {"ok": True, "path": 3, "nbytes": 8}, "path must"),
        (Reserve(1, 0, 8, 1), {"ok": True, "path": "/r", "nbytes": -8}, "nbytes must"),
        (Steps(1), {"ok": True, "steps": [1, "2"]}, "steps must"),
        (Steps(1), {"ok": True, "steps": list(range(70000))}, "steps must"),
        (Locate(1, 0), {"ok": True, "sources": [["memory"]]}, "a source must be an object"),
        (Locate(1, 0), {"ok": True, "sources": [{"node": "n"}]}, "tier must"),
        (Locate(1, 0), {"ok": True, "sources": [{"tier": "peer", "node": "../x"}]}, "node id"),
        (Locate(1, 0), {"ok": True, "sources": [{"tier": "memory", "header": 1}]}, "header"),
        (
            Locate(1, 0),
            {
                "ok": True,
                "sources": [{"tier": "memory", "header": {**HEADER.to_json(), "rank": 9}}],
            },
            "rank must be",
        ),
        (StatusRequest(), {"ok": True}, "missing field 'node'"),
        (StatusRequest(), {"ok": True, "node": "n", "used": "1"}, "Status.used: expected int"),
        (
            StatusRequest(),
            {"ok": True, "node": "n", "shards": [{"step": 1, "rank": 0}]},
            "missing field 'state'",
        ),
        (
            StatusRequest(),
            {"ok": True, "node": "n", "prefetch": [{"step": 1, "rank": 0, "outcome": 3}]},
            "outcome: expected str",
        ),
        (Wait(1, 0, Tier.PEER), {"ok": True, "tiers": "memory"}, "tiers must"),
    ],
)
def test_a_malformed_reply_is_refused_at_the_boundary(
    request_: Any, reply: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        request_.read_reply(reply)


@contextlib.contextmanager
def _connected_to(
    tmp_path: Path, serve: Callable[[socket.socket], None]
) -> Iterator[ServerConnection]:
    """A worker's connection to a stand-in server that answers it with `serve(connection)`, in
    a thread; the server has ended when the block does."""
    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def accept() -> None:
        conn, _ = listener.accept()
        with conn:
            serve(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    connection = ServerConnection(path, timeout_s=10)
    try:
        yield connection
    finally:
        connection.close()
        thread.join(10)
        listener.close()
    assert not thread.is_alive()


def test_a_server_that_sends_a_malformed_reply_is_a_checkpoint_error(tmp_path: Path) -> None:
    """The client turns a reply that does not parse into CheckpointError, which every caller in
    engine.py already handles as a server that cannot answer."""

    def serve(conn: socket.socket) -> None:
        recv_msg(conn)
        send_msg(conn, {"ok": True, "sources": "everywhere"})

    with _connected_to(tmp_path, serve) as connection:
        with pytest.raises(CheckpointError, match="bad reply to 'locate'"):
            connection.request(Locate(1, 0))


def test_replies_to_requests_sent_without_waiting_come_in_order_or_fail_with_the_connection(
    tmp_path: Path,
) -> None:
    """A save every step sends its commit and the next step's reservation without waiting
    (`ServerConnection.send`): the replies are read later, each handed to its own request, in
    order; when the connection is lost before some are read, each of those gets the error."""
    answered = threading.Event()

    def serve(conn: socket.socket) -> None:
        for _ in range(3):
            msg = recv_msg(conn)
            send_msg(conn, {"ok": True, "path": f"/region-{msg['step']}", "nbytes": 64})
        recv_msg(conn)
        recv_msg(conn)  # two more requests, never answered: the server goes away
        answered.set()

    got: list[tuple[int, object]] = []
    with _connected_to(tmp_path, serve) as connection:
        for step in (1, 2, 3):
            connection.send(Reserve(step, 0, 64, 1), lambda r, s=step: got.append((s, r)))
        assert got == []  # nothing read yet
        connection.settle()
        assert [(s, r.path) for s, r in got] == [(n, f"/region-{n}") for n in (1, 2, 3)]
        for step in (4, 5):
            connection.send(Reserve(step, 0, 64, 1), lambda r, s=step: got.append((s, r)))
        assert answered.wait(10)
        connection.settle()
        assert [s for s, _ in got[3:]] == [4, 5]
        assert all(isinstance(r, CheckpointError) for _, r in got[3:])
        assert connection.dropped == 1


def test_the_catalogs_memory_copies_skip_entries_that_are_not_well_formed() -> None:
    entries: dict[str, Any] = {
        "mem-b": {"tier": "memory", "node": "b", "addr": "10.0.0.2:7000"},
        "mem-a": {"tier": "memory", "node": "a", "addr": "10.0.0.1:7000"},
        "storage": {"tier": "storage", "path": "/ckpt/x"},
        "mem-c": {"tier": "memory", "node": "c"},  # no address
        "mem-d": {"tier": "memory", "node": 4, "addr": "10.0.0.4:7000"},
        "mem-e": {"tier": "memory", "node": "e", "addr": ["10.0.0.5", 7000]},
        "mem-f": {"tier": "memory", "node": "f", "addr": ""},
    }
    from test_links import DictStore

    store = DictStore()
    for holder, value in entries.items():
        store.put(catalog.shard_key(1, 0, holder), {"step": 1, "rank": 0, **value})
    store.put(catalog.shard_key(1, 0, "mem-g"), {"step": 2, "rank": 0, "tier": "memory"})
    listed = catalog.holders(store, 1, 0)  # the entries that are listings of shard (1, 0)
    assert sorted(listed) == ["mem-a", "mem-b", "mem-c", "mem-f", "storage"]
    assert catalog.memory_copies(listed) == [
        catalog.MemoryCopy("a", "10.0.0.1:7000"),
        catalog.MemoryCopy("b", "10.0.0.2:7000"),
    ]


def test_discards_read_from_etcd_become_records_and_malformed_ones_are_left_out() -> None:
    value = [
        {"first_bad_step": 9, "generation": 2},
        {"first_bad_step": "9", "generation": 2},
        {"first_bad_step": 9},
        [9, 2],
        {"first_bad_step": 4, "generation": 3, "extra": True},
    ]
    assert catalog.parse_discards(value) == [catalog.Discard(9, 2), catalog.Discard(4, 3)]
    assert catalog.parse_discards({"first_bad_step": 9}) == []
    assert catalog.is_discarded(catalog.parse_discards(value), 10, 1)
    assert not catalog.is_discarded(catalog.parse_discards(value), 3, 1)


def test_a_servers_registration_is_read_as_a_record_and_a_bad_one_is_none() -> None:
    from test_links import DictStore

    class Store(DictStore):
        def get(self, key: str) -> object:
            return self.data.get(key)

    store = Store()
    catalog.register_server(store, "n0", "10.0.0.1:7000", None)
    assert catalog.server_addr(store, "n0") == "10.0.0.1:7000"
    for bad in ({"node": "n1"}, {"node": "n1", "addr": 7}, {"node": "n1", "addr": ""}, "x", None):
        store.put(keys.ckpt_server("n1"), bad)
        assert catalog.server_addr(store, "n1") is None
    assert catalog.servers(store) == {"n0": catalog.ServerRecord("n0", "10.0.0.1:7000")}
