"""The checkpoint server's peer port under abuse: validated frames, a connection cap, an
authentication time limit, a flood of idle and slow connections, and a fuzz of the port."""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import resource
import selectors
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import raw_shard_header, shm_dir_for, wait_for

from transom import checkpoint
from transom.checkpoint import layout, peer_port, peer_service, replication, shard_format
from transom.checkpoint.budget import LOCAL
from transom.checkpoint.peer_port import MAX_PEER_CONNECTIONS, Throttle
from transom.checkpoint.protocol import (
    LENGTH,
    NONCE_BYTES,
    ProtocolError,
    ProtocolTimeout,
    authenticate,
    recv_msg,
)
from transom.checkpoint.server import CheckpointServer
from transom.checkpoint.server_options import ServerConfig

SECRET = b"the job's secret"


def _server(tmp_path: Path, node: str, **kw) -> CheckpointServer:
    cfg = ServerConfig(
        node_id=node,
        socket_path=tmp_path / f"{node}.sock",
        shm_dir=shm_dir_for(tmp_path, f"-{node}"),
        budget_bytes=1 << 30,
        replicas=kw.pop("replicas", 0),
        secret=SECRET,
        **kw,
    )
    return CheckpointServer(cfg).start()


def _addr(server: CheckpointServer) -> tuple[str, int]:
    host, _, port = server.addr.rpartition(":")
    return host, int(port)


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        for k in a
    )


def _fingerprint(server: CheckpointServer) -> dict:
    """Every shard the server holds: its state, tiers, origin, header and a hash of its bytes."""
    with server.memory.lock:
        return {
            key: (
                s.state,
                sorted(s.tiers),
                s.origin,
                json.dumps(s.header.to_json() if s.header else None, sort_keys=True),
                hashlib.sha256(s.region.view()[: s.header.data_len]).hexdigest()
                if s.header
                else None,
            )
            for key, s in server.memory.shards.items()
        }


@contextlib.contextmanager
def _file_limit(needed: int):
    """Raise the soft RLIMIT_NOFILE to `needed` (at most the hard limit) for the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        top = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if top < needed:
            pytest.skip(f"needs {needed} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- frames and requests, without a server ------------------------------------------------------


@pytest.mark.parametrize(
    "msg, problem",
    [
        ({"op": "delete", "step": 1, "rank": 0}, "unknown request"),
        ({"op": "get", "step": "1", "rank": 0}, "step must be an integer"),
        ({"op": "get", "step": True, "rank": 0}, "step must be an integer"),
        ({"op": "get", "step": 1.0, "rank": 0}, "step must be an integer"),
        ({"op": "get", "step": -1, "rank": 0}, "step must be an integer"),
        ({"op": "get", "step": 1 << 70, "rank": 0}, "step must be an integer"),
        ({"op": "get", "step": 1}, "rank must be an integer"),
        (
            {"op": "put", "step": 1, "rank": 0, "header_len": 10, "data_len": 0, "origin": "n"},
            "header_len",
        ),
        (
            {"op": "put", "step": 1, "rank": 0, "header_len": 1 << 40, "data_len": 0},
            "header_len",
        ),
        (
            {"op": "put", "step": 1, "rank": 0, "header_len": 4096, "data_len": 1 << 50},
            "data_len",
        ),
        (
            {
                "op": "put",
                "step": 1,
                "rank": 0,
                "header_len": 4096,
                "data_len": 8,
                "origin": "../x",
            },
            "origin",
        ),
    ],
)
def test_peer_requests_are_validated(msg: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        replication.parse_request(msg)


def test_a_valid_put_request_is_parsed() -> None:
    msg = {"op": "put", "step": 3, "rank": 1, "header_len": 4096, "data_len": 64, "origin": "n1"}
    assert replication.parse_request(msg) == replication.PutRequest(3, 1, 4096, 64, "n1")
    assert replication.parse_request({"op": "get", "step": 3, "rank": 1}) == (
        replication.GetRequest(3, 1)
    )


def test_frames_over_the_limit_or_not_objects_are_refused_unread() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(LENGTH.pack(1 << 30))  # a gigabyte announced: refused before any is read
        with pytest.raises(ProtocolError, match="too large"):
            recv_msg(b, max_bytes=1024)
        for body in (b"[" * 60000, b"[1, 2]", b"\xff\xfe", b"nul"):
            a.sendall(LENGTH.pack(len(body)) + body)
            with pytest.raises(ProtocolError, match="not"):
                recv_msg(b)


def test_a_frame_that_stops_half_way_times_out() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(LENGTH.pack(100)[:2])
        t0 = time.monotonic()
        with pytest.raises(ProtocolTimeout):
            recv_msg(b, frame_timeout_s=0.3)
        assert time.monotonic() - t0 < 5
    c, d = socket.socketpair()
    with c, d, pytest.raises(ProtocolTimeout):  # and a silent side past the caller's deadline
        recv_msg(c, deadline=time.monotonic() + 0.2)


def test_throttle_reports_once_per_interval_with_the_count() -> None:
    throttle = Throttle(interval_s=3600)
    assert throttle.hit() == 1
    assert [throttle.hit() for _ in range(5)] == [None] * 5
    throttle.last -= 3600
    assert throttle.hit() == 6


# -- the peer port of a running server ----------------------------------------------------------


def test_a_connection_that_does_not_authenticate_in_time_is_closed(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(peer_port, "AUTH_TIMEOUT_S", 0.5)
    server = _server(tmp_path, "n0")
    try:
        with socket.create_connection(_addr(server), timeout=10) as sock:
            t0 = time.monotonic()
            assert len(sock.recv(NONCE_BYTES)) > 0  # the server's challenge
            while sock.recv(4096):  # ... then nothing, until it closes the connection
                pass
            assert time.monotonic() - t0 < 5
        wait_for(lambda: not server._tcp.pending, 10, "the connection to be released")
        assert server._tcp.connections() == 0
    finally:
        server.stop()


def test_both_ends_of_a_peer_connection_send_without_waiting_for_acks(
    tmp_path: Path, monkeypatch
) -> None:
    """TCP_NODELAY on both ends: a reply followed by a shard header (or a request after the
    handshake) must not sit out the peer's delayed acknowledgement."""
    served: list[int] = []
    send_at_once = peer_port.send_at_once

    def recording(sock):
        send_at_once(sock)
        served.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    monkeypatch.setattr(peer_port, "send_at_once", recording)
    server = _server(tmp_path, "n0")
    try:
        sock = replication.connect(server.addr, SECRET)
        with sock:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert served and served[0] != 0
    finally:
        server.stop()


def test_unauthenticated_connections_never_crowd_out_a_replication(tmp_path: Path) -> None:
    """Another local user holds 200 connections open against a node's peer port, reopening any
    it closes: every replication to that node still gets through, and the port's threads stay
    at one (the handshakes run in its selector) and its pending connections under their cap."""
    peer = _server(tmp_path, "n1")
    origin = _server(tmp_path, "n0", replicas=1, peer=peer.addr)
    engine = checkpoint.Engine(socket_path=str(tmp_path / "n0.sock"), rank=0, world_size=1)
    try:
        state = {"w": torch.randn(1000)}
        threads = threading.active_count()
        with Flood(_addr(peer), idle=200, slow=10, reopen_per_s=20000) as flood:
            wait_for(lambda: flood.most_open >= 200, 30, "200 connections to be open")
            replicated = 0
            for step in range(1, 21):
                engine.save(step, state).wait("peer", timeout=30)
                replicated += 1
                assert len(peer._tcp.pending) <= peer_port.MAX_PENDING_AUTH
                assert threading.active_count() <= threads + 2 + MAX_PEER_CONNECTIONS
            assert peer._tcp.evicted > 0  # the flood was at the caps, and made room for peers
        assert replicated == 20
        header, data = replication.fetch(peer.addr, SECRET, 20, 0)
        assert _same(state, layout.rebuild(header, data))
    finally:
        engine.close()
        origin.stop()
        peer.stop()


def test_authenticated_connections_beyond_the_cap_are_closed_at_once(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(peer_service, "FRAME_TIMEOUT_S", 30.0)  # held peers wait for a request
    server = _server(tmp_path, "n0")
    engine = checkpoint.Engine(socket_path=str(tmp_path / "n0.sock"), rank=0, world_size=1)
    held: list[socket.socket] = []
    try:
        state = {"w": torch.randn(1000)}
        engine.save(1, state).wait("memory", timeout=30)
        held = [replication.connect(server.addr, SECRET) for _ in range(MAX_PEER_CONNECTIONS)]
        wait_for(
            lambda: server._tcp.connections() == MAX_PEER_CONNECTIONS, 10, "the port to be full"
        )
        threads = threading.active_count()
        for _ in range(5):
            extra = replication.connect(server.addr, SECRET)  # proved, then closed at once
            with extra:
                extra.settimeout(5)
                assert extra.recv(1) == b""
        assert server._tcp.refused == 5
        assert threading.active_count() <= threads  # no thread for a refused connection
        saved = engine.save(2, state)
        assert saved.ok  # workers are not affected
        saved.wait("memory", timeout=30)
        for sock in held:
            sock.close()
        wait_for(lambda: server._tcp.connections() == 0, 10, "the held connections to end")
        header, data = replication.fetch(server.addr, SECRET, 2, 0)  # peers get in again
        assert _same(state, layout.rebuild(header, data))
    finally:
        for sock in held:
            sock.close()
        engine.close()
        server.stop()


def test_a_replica_never_replaces_a_shard_of_this_nodes_workers(tmp_path: Path) -> None:
    server = _server(tmp_path, "n0")
    engine = checkpoint.Engine(socket_path=str(tmp_path / "n0.sock"), rank=0, world_size=1)
    try:
        state = {"w": torch.randn(1000)}
        engine.save(1, state).wait("memory", timeout=30)
        before = _fingerprint(server)
        shard = server.memory.shards[(1, 0)]
        for origin in ("n1", "local"):
            with pytest.raises(replication.ReplicationError, match="own workers|origin"):
                replication.push(
                    server.addr,
                    SECRET,
                    shard.header,
                    shard.header_bytes,
                    shard.region.path,
                    origin,
                )
        assert _fingerprint(server) == before
    finally:
        engine.close()
        server.stop()


def test_a_replica_keeps_the_header_bytes_it_verified_with_the_padding_zeroed(
    tmp_path: Path,
) -> None:
    origin, peer = _server(tmp_path, "n0"), _server(tmp_path, "n1")
    engine = checkpoint.Engine(socket_path=str(tmp_path / "n0.sock"), rank=0, world_size=1)
    try:
        engine.save(1, {"w": torch.randn(1000)}).wait("memory", timeout=30)
        shard = origin.memory.shards[(1, 0)]
        assert shard.header is not None
        body_end = shard_format.PREFIX.size + shard_format.decode_prefix(shard.header_bytes)[0]
        assert body_end < len(shard.header_bytes)  # there is padding to fill
        dirty = shard.header_bytes[:body_end] + b"\xff" * (len(shard.header_bytes) - body_end)
        replication.push(peer.addr, SECRET, shard.header, dirty, shard.region.path, "n0")
        replica = peer.memory.shards[(1, 0)]
        assert replica.header == shard.header
        assert replica.header_bytes == shard_format.encode_header(shard.header)
    finally:
        engine.close()
        origin.stop()
        peer.stop()


class Flood:
    """`idle` connections to a port, opened at once and kept open (those the server closes are
    reopened, at most `reopen_per_s` a second), `slow` of them sending a garbage byte every
    0.2 s."""

    def __init__(self, addr, idle: int, slow: int, reopen_per_s: int = 1000):
        self.addr, self.idle, self.slow = addr, idle, slow
        self.reopen_per_s = reopen_per_s
        self.stop = threading.Event()
        self.opened = 0
        self.most_open = 0
        self.socks: set[socket.socket] = set()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, sel: selectors.BaseSelector) -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(self.addr)
        sel.register(sock, selectors.EVENT_READ)
        self.socks.add(sock)
        self.opened += 1
        return sock

    def _drop(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        sel.unregister(sock)
        self.socks.discard(sock)
        sock.close()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        slow: list[socket.socket] = []
        rng = random.Random(5)
        next_drip = 0.0
        try:
            budget = self.idle + self.slow  # all at once, then reopened at reopen_per_s
            while not self.stop.is_set():
                while len(self.socks) < self.idle + self.slow and budget:
                    sock = self._open(sel)
                    budget -= 1
                    if len(slow) < self.slow:
                        slow.append(sock)
                self.most_open = max(self.most_open, len(self.socks))
                budget = max(1, self.reopen_per_s // 20)
                for key, _ in sel.select(timeout=0.05):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        data = sock.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        if sock in slow:
                            slow.remove(sock)
                        self._drop(sel, sock)
                if time.monotonic() > next_drip:
                    next_drip = time.monotonic() + 0.2
                    for sock in slow:
                        with contextlib.suppress(OSError):
                            sock.send(bytes([rng.randrange(256)]))
        finally:
            for sock in list(self.socks):
                self._drop(sel, sock)
            sel.close()

    def __enter__(self) -> Flood:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def test_a_thousand_idle_and_slow_connections_do_not_delay_a_save(tmp_path: Path) -> None:
    with _file_limit(4096):
        server = _server(tmp_path, "n0")
        engine = checkpoint.Engine(socket_path=str(tmp_path / "n0.sock"), rank=0, world_size=1)
        try:
            state = {"w": torch.randn(1 << 20)}

            def save_seconds(step: int) -> float:
                t0 = time.perf_counter()
                handle = engine.save(step, state)
                took = time.perf_counter() - t0
                assert handle.ok, handle.error
                handle.wait("memory", timeout=30)
                return took

            quiet = [save_seconds(step) for step in range(1, 6)]
            threads = threading.active_count()
            with Flood(_addr(server), idle=1000, slow=8) as flood:
                wait_for(lambda: flood.most_open >= 1000, 30, "1,000 connections to be open")
                flooded = [save_seconds(step) for step in range(6, 16)]
                assert server._tcp.evicted > 0  # the caps were reached ...
                assert len(server._tcp.pending) <= peer_port.MAX_PENDING_AUTH
                # ... and the server's threads stay bounded (+ the flood's and a wait's).
                assert threading.active_count() <= threads + 3 + MAX_PEER_CONNECTIONS
            assert max(flooded) - statistics.median(quiet) < 1.0, (quiet, flooded)
            header, data = replication.fetch(server.addr, SECRET, 15, 0)
            assert _same(state, layout.rebuild(header, data))
        finally:
            engine.close()
            server.stop()


# -- fuzz -----------------------------------------------------------------------------------------


def _frames(rng: random.Random, count: int, shard: tuple[dict, bytes]) -> list[tuple[bool, bytes]]:
    """(authenticate first?, bytes) for `count` random and crafted frames; `shard` is (header,
    header bytes) of a real shard, to craft plausible puts from."""
    header, header_bytes = shard

    def framed(body: bytes) -> bytes:
        return LENGTH.pack(len(body)) + body

    def request(**fields) -> bytes:
        return framed(json.dumps(fields).encode())

    def put(**over) -> dict:
        return {
            "op": "put",
            "step": 9,
            "rank": 0,
            "origin": "fuzz",
            "header_len": len(header_bytes),
            "data_len": header["data_len"],
            **over,
        }

    def other_shard(step: int, data_len: int = 4096) -> bytes:
        return raw_shard_header({**header, "step": step, "data_len": data_len})

    junk_values = [None, True, -1, 1.5, "1", [], {}, 1 << 64, "../../etc", "x" * 300]
    kinds = [
        lambda: (False, rng.randbytes(rng.randrange(0, 200))),
        lambda: (False, rng.randbytes(rng.randrange(0, NONCE_BYTES))),
        lambda: (False, rng.randbytes(NONCE_BYTES + 32)),  # a nonce and a wrong proof
        lambda: (True, b""),
        lambda: (True, LENGTH.pack(rng.randrange(1 << 32))[: rng.randrange(1, 4)]),
        lambda: (True, LENGTH.pack(rng.randrange(1 << 17, 1 << 32)) + rng.randbytes(64)),
        lambda: (True, framed(rng.randbytes(rng.randrange(1, 300)))),
        lambda: (True, framed(rng.choice([b"[1]", b"null", b"1e999", b"[" * 50000, b"{"]))),
        lambda: (True, request(op=rng.choice(junk_values + ["PUT", "del", "get "]))),
        lambda: (True, request(op="get", step=rng.choice(junk_values), rank=0)),
        lambda: (True, request(op="get", step=rng.randrange(100), rank=rng.randrange(4))),
        lambda: (True, request(**put(**{rng.choice(list(put())): rng.choice(junk_values)}))),
        lambda: (True, request(**put(header_len=rng.randrange(1 << 40)))),
        lambda: (True, request(**put(data_len=rng.randrange(1 << 50)))),
        lambda: (True, request(**put()) + rng.randbytes(rng.randrange(0, 5000))),
        lambda: (True, request(**put()) + header_bytes[: rng.randrange(len(header_bytes))]),
        # the real shard's header, announced as another step or as its own (held) key
        lambda: (True, request(**put()) + header_bytes),
        lambda: (True, request(**put(step=header["step"])) + header_bytes + b"\0" * 100),
        # a header that checks out for a new step, then wrong data
        lambda: (
            True,
            request(**put(step=7, header_len=len(other_shard(7)), data_len=4096))
            + other_shard(7)
            + rng.randbytes(4096),
        ),
    ]
    return [rng.choice(kinds)() for _ in range(count)]


def _send_frame(addr, authenticated: bool, data: bytes, secret: bytes = SECRET) -> None:
    """One connection: (the handshake,) the bytes, end of sending, then read until closed."""
    for _attempt in range(5):
        try:
            with socket.create_connection(addr, timeout=30) as sock:
                if authenticated:
                    authenticate(sock, secret, initiator=True, deadline=time.monotonic() + 30)
                with contextlib.suppress(OSError):
                    sock.sendall(data)
                    sock.shutdown(socket.SHUT_WR)
                with contextlib.suppress(OSError):
                    while sock.recv(1 << 16):
                        pass
            return
        except (ProtocolError, OSError):  # the port was full for a moment: again
            time.sleep(0.05)
    raise AssertionError("the peer port did not take a connection in 5 tries")


def _fuzz(tmp_path: Path, count: int) -> None:
    a = _server(tmp_path, "n0", replicas=1)
    b = _server(tmp_path, "n1", replicas=1)
    a.cfg.peer, b.cfg.peer = b.addr, a.addr
    worker_a = checkpoint.Engine(socket_path=str(tmp_path / "n0.sock"), rank=0, world_size=2)
    worker_b = checkpoint.Engine(socket_path=str(tmp_path / "n1.sock"), rank=1, world_size=2)
    try:
        torch.manual_seed(0)
        state_a, state_b = {"w": torch.randn(5000)}, {"w": torch.randn(3000)}
        worker_a.save(1, state_a).wait("peer", timeout=30)
        worker_b.save(1, state_b).wait("peer", timeout=30)  # a replica in a
        before = _fingerprint(a)
        assert set(before) == {(1, 0), (1, 1)}
        own = a.memory.shards[(1, 0)]
        frames = _frames(random.Random(12), count, (own.header.to_json(), own.header_bytes))
        with ThreadPoolExecutor(8) as pool:
            for future in [pool.submit(_send_frame, _addr(a), *f) for f in frames]:
                future.result()
        wait_for(lambda: a._tcp.connections() == 0, 30, "every fuzz connection to end")
        assert a._tcp.failed == 0  # every bad frame was refused by validation, none crashed
        assert _fingerprint(a) == before
        # Legitimate traffic works, bit-exactly: save + replicate both ways, fetch, load.
        worker_a.save(2, state_a).wait("peer", timeout=30)
        worker_b.save(2, state_b).wait("peer", timeout=30)
        for server, rank, state in ((b, 0, state_a), (a, 1, state_b), (a, 0, state_a)):
            header, data = replication.fetch(server.addr, SECRET, 2, rank)
            assert _same(state, layout.rebuild(header, data))
        assert _same(state_a, worker_a.load(2))
        assert _same(state_b, worker_b.load(2))
    finally:
        worker_a.close()
        worker_b.close()
        a.stop()
        b.stop()


def test_fuzzed_peer_port_keeps_its_shards_and_serves_on(tmp_path: Path) -> None:
    _fuzz(tmp_path, 600)


@pytest.mark.slow
def test_ten_thousand_fuzzed_frames_change_nothing(tmp_path: Path) -> None:
    _fuzz(tmp_path, 10_000)


def test_the_previous_replica_stays_until_the_next_one_is_complete(tmp_path: Path) -> None:
    """A peer that dies while its next replica arrives leaves the one before (the budget has
    room for both); once the next one is complete, the one before goes."""
    from transom.checkpoint.protocol import deadline_in, send_all, send_msg

    origin, peer = _server(tmp_path, "n0"), _server(tmp_path, "n1")
    engine = checkpoint.Engine(socket_path=str(tmp_path / "n0.sock"), rank=0, world_size=1)
    try:
        for step in (1, 2):
            engine.save(step, {"w": torch.full((4096,), float(step))}).wait("memory", timeout=30)
        one, two = origin.memory.shards[(1, 0)], origin.memory.shards[(2, 0)]
        assert one.header is not None and two.header is not None
        replication.push(peer.addr, SECRET, one.header, one.header_bytes, one.region.path, "n0")
        # Step 2's replica: its header and half its data, then the origin is gone.
        sock = replication.connect(peer.addr, SECRET)
        put = {
            "op": "put",
            "step": 2,
            "rank": 0,
            "origin": "n0",
            "header_len": len(two.header_bytes),
            "data_len": two.header.data_len,
        }
        send_msg(sock, put, deadline_in(5))
        send_all(sock, two.header_bytes, deadline_in(5))
        send_all(sock, b"\0" * (two.header.data_len // 2), deadline_in(5))
        # The server holds the reservation while it waits for the rest (checked before the
        # close: a check after it could run before the server had even read the request).
        wait_for(lambda: (2, 0) in peer.memory.shards, 10, "step 2 reserved on the peer")
        sock.close()
        wait_for(lambda: (2, 0) not in peer.memory.shards, 10, "the broken put given back")
        assert (1, 0) in peer.memory.shards  # the previous replica is still there
        replication.push(peer.addr, SECRET, two.header, two.header_bytes, two.region.path, "n0")
        assert set(peer.memory.shards) == {(2, 0)}  # complete: the one before made way
    finally:
        engine.close()
        origin.stop()
        peer.stop()


def test_a_pusher_keeps_one_connection_for_a_peer_and_reconnects_when_it_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save every step pushes a replica every step: one connection (one challenge, one server
    thread) serves them all. A connection the server ended (idle, or the server restarted its
    port) costs the next push a new one, never the push itself; a refused put ends it."""
    origin, peer = _server(tmp_path, "n0"), _server(tmp_path, "n1")
    engine = checkpoint.Engine(socket_path=str(tmp_path / "n0.sock"), rank=0, world_size=1)
    pusher = replication.Pusher(SECRET)
    accepted = []
    real_connect = replication.connect
    monkeypatch.setattr(replication, "connect", lambda *a: accepted.append(a) or real_connect(*a))

    def save_and_push(step: int) -> None:
        engine.save(step, {"w": torch.full((4096,), float(step))}).wait("memory", timeout=30)
        shard = origin.memory.shards[(step, 0)]
        assert shard.header is not None
        pusher.push(peer.addr, shard.header, shard.header_bytes, shard.region.path, "n0")

    try:
        save_and_push(1)
        save_and_push(2)
        assert len(accepted) == 1 and (2, 0) in peer.memory.shards
        wait_for(lambda: peer._tcp.connections() == 1, 10, "one connection served")
        # the server ends it (as at KEEP_ALIVE_S, or a restart of its port): the next push
        # makes a new one and succeeds
        for conn in list(peer._tcp.active):
            conn.shutdown(socket.SHUT_RDWR)
        wait_for(lambda: peer._tcp.connections() == 0, 10, "the connection ended")
        save_and_push(3)
        assert len(accepted) == 2 and (3, 0) in peer.memory.shards
        # a refused put (a replica may not replace this node's own shard) ends the connection
        with peer.memory.lock:
            peer.memory.shards[(3, 0)].origin = LOCAL
        with pytest.raises(replication.ReplicationError, match="refused"):
            shard = origin.memory.shards[(3, 0)]
            assert shard.header is not None
            pusher.push(peer.addr, shard.header, shard.header_bytes, shard.region.path, "n0")
        save_and_push(4)
        assert len(accepted) == 3 and (4, 0) in peer.memory.shards
    finally:
        pusher.close()
        engine.close()
        origin.stop()
        peer.stop()
