"""The monitor channel: the datagram schema (every field checked, never raising), the socket's
private directory, and the attacks of issue 12 replayed against a live NodeMonitor."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import wait_for

from transom.faults import MockNvml
from transom.monitor import datagram, detectors, reporter
from transom.monitor.channel import (
    DIR_PREFIX,
    PATH_LIMIT,
    SOCKET_NAME,
    STALE_AFTER_S,
    dir_prefix,
    sweep_stale,
)
from transom.monitor.node import (
    ACCEPTED,
    FOREIGN_RANK,
    FOREIGN_SENDER,
    STALE_GENERATION,
    NodeMonitor,
)
from transom.monitor.rank_timing import WARMUP_STEPS

GEN = 4
RANK = 2


def valid(kind: str = "step", **values) -> dict:
    base = {"k": kind, "rank": RANK, "gen": GEN, "t": 1.7e9}
    defaults = {
        "step": {"step": 9, "dur": 0.1, "comm": 0.02, "compute": 0.08, "loss": 2.5, "tokens": 96},
        "steps": {"steps": [batched(8), batched(9)]},
        "beat": {"step": 9, "phase": None},
        "phase": {"step": 9, "phase": "checkpoint"},
        "fault": {"step": 9, "fault": {"id": "f0", "type": "nan", "step": 9}},
        "fingerprint": {"step": 9, "fp": "9f2c4e1a07b3d865", "dev": [[3, 12.5], [40, 1.0]]},
    }[kind]
    return base | defaults | values


def batched(step: int, **values) -> dict:
    """One record of a steps datagram."""
    return {"t": 1.7e9 + step, "step": step, "dur": 0.1, "comm": 0.02, "loss": 2.5} | values


def parse(message) -> datagram.Message | datagram.Rejection:
    data = message if isinstance(message, bytes) else json.dumps(message).encode()
    return datagram.parse(data)


# -- the schema (no socket) -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(datagram.KINDS - {"steps"}))
def test_what_the_worker_encodes_the_agent_accepts(kind):
    values = {k: v for k, v in valid(kind).items() if k not in ("k", "rank", "gen", "t")}
    parsed = datagram.parse(datagram.encode(kind, RANK, GEN, 1.7e9, **values))
    assert isinstance(parsed, datagram.Message), parsed
    assert (parsed.kind, parsed.rank, parsed.generation, parsed.t) == (kind, RANK, GEN, 1.7e9)
    assert parsed.values == {k: float(v) if k == "tokens" else v for k, v in values.items()}


def test_a_batch_of_steps_is_parsed_as_the_step_datagrams_it_holds():
    records = [(1.7e9 + i, {"step": i, "dur": 0.1, "comm": 0.02, "lr": 0.1}) for i in range(3)]
    parsed = datagram.parse(datagram.encode_steps(RANK, GEN, records))
    assert isinstance(parsed, datagram.Message) and parsed.kind == "steps"
    assert (parsed.rank, parsed.generation) == (RANK, GEN)
    steps = parsed.values["steps"]
    assert [(s.kind, s.rank, s.generation, s.t) for s in steps] == [
        ("step", RANK, GEN, 1.7e9 + i) for i in range(3)
    ]
    assert [s.values for s in steps] == [values for _, values in records]
    too_many = [(1.0, {"step": i}) for i in range(datagram.MAX_BATCH + 5)]
    parsed = datagram.parse(datagram.encode_steps(RANK, GEN, too_many))
    assert isinstance(parsed, datagram.Message)
    assert len(parsed.values["steps"]) == datagram.MAX_BATCH


def test_the_encoder_keeps_user_metrics_apart_from_the_schema():
    data = datagram.encode("step", RANK, GEN, 1.0, step=3, gen=99, lr=0.1, **{"a b": 2.0})
    parsed = datagram.parse(data)
    assert isinstance(parsed, datagram.Message) and parsed.generation == GEN
    assert parsed.values == {"step": 3, "lr": 0.1, "a b": 2.0}
    many = {f"m{i}": 1.0 for i in range(datagram.MAX_METRICS + 5)}
    parsed = datagram.parse(datagram.encode("step", RANK, GEN, 1.0, step=1, **many))
    assert isinstance(parsed, datagram.Message) and len(parsed.values) == 1 + datagram.MAX_METRICS


def test_a_nan_loss_is_valid_and_stays_nan():
    for loss in (float("nan"), float("inf"), float("-inf")):
        parsed = parse(valid(loss=loss))  # json writes NaN, Infinity, -Infinity
        assert isinstance(parsed, datagram.Message) and not math.isfinite(parsed.values["loss"])


BAD_FIELDS = [
    # the cases
    ({"k": "step", "rank": 0}, None),
    ({"dur": "x"}, None),
    # kind and sender
    (valid() | {"k": "stepx"}, None),
    (valid() | {"k": 1}, None),
    ({kk: v for kk, v in valid().items() if kk != "k"}, None),
    (valid() | {"rank": True}, None),
    (valid() | {"rank": 2.0}, None),
    (valid() | {"rank": "2"}, None),
    (valid() | {"rank": -1}, None),
    (valid() | {"rank": datagram.MAX_RANK}, None),
    (valid() | {"rank": None}, None),
    ({kk: v for kk, v in valid().items() if kk != "gen"}, None),
    (valid() | {"gen": -3}, None),
    (valid() | {"gen": 10**40}, None),
    (valid() | {"t": float("nan")}, None),
    (valid() | {"t": None}, None),
    (valid() | {"t": -1}, None),
    # step fields
    ({kk: v for kk, v in valid().items() if kk != "step"}, None),
    (valid() | {"step": -1}, None),
    (valid() | {"step": 1.5}, None),
    (valid() | {"step": 10**30}, None),
    (valid() | {"dur": "x"}, None),
    (valid() | {"dur": float("nan")}, None),
    (valid() | {"dur": float("inf")}, None),
    (valid() | {"dur": -0.5}, None),
    (valid() | {"dur": 1e300}, None),
    (valid() | {"dur": True}, None),
    (valid() | {"compute": -1.0}, None),
    (valid() | {"compute": 1e9}, None),
    (valid() | {"compute": float("nan")}, None),
    (valid() | {"compute": 5.0}, None),  # longer than the step
    (valid() | {"comm": 0.2}, None),
    (valid() | {"comm": [1]}, None),
    (valid() | {"tokens": -5}, None),
    (valid() | {"tokens": float("inf")}, None),
    (valid() | {"loss": "nan"}, None),
    (valid() | {"loss": {"a": 1}}, None),
    (valid() | {"phase": "checkpoint"}, None),  # a step's phases are a list
    (valid() | {"phase": [1, 2]}, None),
    (valid() | {"phase": ["x"] * (datagram.MAX_PHASES + 1)}, None),
    (valid() | {"phase": ["y" * (datagram.MAX_NAME + 1)]}, None),
    (valid() | {f"m{i}": 1.0 for i in range(datagram.MAX_METRICS + 1)}, None),
    (valid() | {"lr": "high"}, None),
    (valid() | {"x" * (datagram.MAX_NAME + 1): 1.0}, None),
    # the other kinds
    (valid("beat") | {"extra": 1}, None),
    (valid("beat") | {"phase": ["a"]}, None),
    (valid("beat") | {"phase": "bad\nname"}, None),
    (valid("phase") | {"step": "9"}, None),
    (valid("fault") | {"fault": "nan"}, None),
    (valid("fault") | {"fault": {"type": "nan"}}, None),
    (valid("fault") | {"fault": {"id": 3, "type": "nan"}}, None),
    (valid("fault") | {"fault": None}, None),
    ({kk: v for kk, v in valid("fault").items() if kk != "fault"}, None),
    (valid("fingerprint") | {"dev": None}, None),
    (valid("fingerprint") | {"dev": [[1, 2.0]] * (datagram.MAX_DEVIATIONS + 1)}, None),
    (valid("fingerprint") | {"dev": [[1.5, 2.0]]}, None),
    (valid("fingerprint") | {"dev": [[-1, 2.0]]}, None),
    (valid("fingerprint") | {"dev": [[1, 0.0]]}, None),
    (valid("fingerprint") | {"dev": [[1, float("inf")]]}, None),
    (valid("fingerprint") | {"dev": [[1, True]]}, None),
    (valid("fingerprint") | {"dev": [[1, 2.0, 3]]}, None),
    (valid("fingerprint") | {"dev": {"1": 2.0}}, None),
    # a batch of steps: one bad record refuses it all, and no record speaks for another rank
    (valid("steps") | {"steps": []}, None),
    (valid("steps") | {"steps": [batched(1)] * (datagram.MAX_BATCH + 1)}, None),
    (valid("steps") | {"steps": [batched(1), "step"]}, None),
    (valid("steps") | {"steps": [batched(1), batched(2, dur="x")]}, None),
    (valid("steps") | {"steps": [batched(1), batched(2, comm=0.5)]}, None),
    (valid("steps") | {"steps": [batched(1), {"t": 1.0}]}, None),
    (valid("steps") | {"steps": [batched(1), batched(2, rank=RANK + 1)]}, None),
    (valid("steps") | {"steps": [batched(1, gen=GEN + 1)]}, None),
    (valid("steps") | {"steps": [batched(1, k="beat")]}, None),
    (valid("steps") | {"steps": [batched(1, steps=[batched(2)])]}, None),
    (valid("steps") | {"steps": {"0": batched(1)}}, None),
    # not a JSON object at all
    (b"", datagram.NOT_JSON),
    (b"\xff\xfe\x00garbage", datagram.NOT_JSON),
    (b'{"k": "step", "rank": 0', datagram.NOT_JSON),
    (b"[1, 2]", datagram.NOT_JSON),
    (b"null", datagram.NOT_JSON),
    (b"[" * 4000, datagram.NOT_JSON),
    (b"[" * 2000 + b"]" * 2000, datagram.NOT_JSON),  # nested past the recursion limit
    (b"[" * 100_000, datagram.OVERSIZE),
    (b'{"k":"step","rank":' + b"9" * 4050 + b"}", None),  # a huge integer
    (b'{"k":"step","rank":' + b"9" * datagram.MAX_BYTES + b"}", datagram.OVERSIZE),
    (json.dumps(valid() | {"pad": "x" * datagram.MAX_BYTES}).encode(), datagram.OVERSIZE),
]


@pytest.mark.parametrize("message,reason", BAD_FIELDS, ids=lambda v: repr(v)[:60])
def test_every_malformed_datagram_is_rejected_with_its_reason(message, reason):
    parsed = parse(message)
    assert isinstance(parsed, datagram.Rejection), parsed
    assert parsed.reason == (reason or datagram.INVALID), parsed


def test_the_valid_templates_are_valid():
    """The cases above each break one field of a valid datagram: a valid one must pass."""
    for kind in datagram.KINDS:
        assert isinstance(parse(valid(kind)), datagram.Message)


# -- the socket ---------------------------------------------------------------------------------


@pytest.fixture
def node():
    """A NodeMonitor of generation GEN expecting RANK and RANK + 1."""
    monitor = NodeMonitor("nodeY", nvml=MockNvml(), scope="/some/run/dir")
    monitor.new_generation(GEN)
    monitor.expect_ranks([RANK, RANK + 1])
    yield monitor
    monitor.close()


def send(node: NodeMonitor, *messages) -> None:
    """Send datagrams as the workers would, then wait until the listener counted them all."""
    before = sum(node.counters().values())
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.settimeout(10)
        for m in messages:
            s.sendto(m if isinstance(m, bytes) else json.dumps(m).encode(), str(node.socket_path))
    wait_for(lambda: sum(node.counters().values()) == before + len(messages), 10, "the datagrams")


def test_the_socket_lives_in_a_private_directory_removed_on_close():
    monitor = NodeMonitor("node-a", nvml=MockNvml(), scope="/runs/job")
    path = monitor.socket_path
    info = os.lstat(path.parent)
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.geteuid()
    assert path.parent.name.startswith(dir_prefix("/runs/job", "node-a"))
    assert dir_prefix("/runs/job", "node-a") != dir_prefix("/runs/other", "node-a")
    assert len(os.fsencode(path)) < PATH_LIMIT
    monitor.close()
    assert not path.parent.exists()


def test_directories_of_dead_channels_are_swept_and_live_ones_kept():
    base = Path(tempfile.mkdtemp(prefix="sweep-", dir="/tmp"))  # short: socket paths fit
    live = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        dead, empty, alive, young = (
            base / f"{DIR_PREFIX}{name}" for name in ("dead", "empty", "alive", "young")
        )
        for path in (dead, empty, alive, young):
            path.mkdir(mode=0o700)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.bind(str(dead / SOCKET_NAME))  # closed without unlinking: refuses connections
        live.bind(str(alive / SOCKET_NAME))
        (base / f"{DIR_PREFIX}link").symlink_to(empty)  # not a directory itself: left alone
        old = time.time() - 2 * STALE_AFTER_S
        for path in (dead, empty, alive):
            os.utime(path, (old, old))
        assert sorted(sweep_stale(base)) == [dead, empty]
        assert alive.exists() and young.exists() and not dead.exists()
    finally:
        live.close()
        shutil.rmtree(base)


@pytest.mark.integration
@pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0, reason="needs root to act as another user"
)
def test_another_user_cannot_reach_the_socket(node):
    pid = os.fork()
    if pid == 0:  # the child: become nobody, try to send
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(json.dumps(valid()).encode(), str(node.socket_path))
        except PermissionError:
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "another user could send to the socket"
    assert sum(node.counters().values()) == 0


@pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0, reason="needs root to forge credentials"
)
def test_a_datagram_with_another_uid_is_counted_and_dropped(node):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        credentials = struct.pack("iII", os.getpid(), 65534, 65534)
        s.sendmsg(
            [json.dumps(valid()).encode()],
            [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, credentials)],
            0,
            str(node.socket_path),
        )
    wait_for(lambda: node.counters()[FOREIGN_SENDER] == 1, 10, "the foreign datagram")
    assert node.steps() == {}


def test_a_step_queued_while_a_batch_is_being_sent_does_not_wait_for_the_send(
    tmp_path, monkeypatch
):
    """The training thread only queues a step; the sender thread's encoding and sending of the
    batch before it must not hold it up (they used to run under the queue's lock)."""
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(str(tmp_path / "agent.sock"))
    agent.settimeout(10)
    entered, release = threading.Event(), threading.Event()
    encode_steps = datagram.encode_steps

    def slow_encode(rank, generation, records, stopped=None):
        if records[0][1]["step"] == 1:  # the first batch: held mid-encode by the test
            entered.set()
            release.wait(10)
        return encode_steps(rank, generation, records, stopped)

    monkeypatch.setattr(datagram, "encode_steps", slow_encode)
    monkeypatch.setenv("RANK", "0")
    channel = reporter._Channel(str(tmp_path / "agent.sock"))
    try:
        channel.queued_at = time.time() + 3600  # no step counts as slow: all of them wait
        channel.pending.append((time.time(), {"step": 1}))
        sender = threading.Thread(target=channel.flush, daemon=True)
        sender.start()
        assert entered.wait(10)
        queued = threading.Thread(target=channel.send_step, args=({"step": 2},), daemon=True)
        queued.start()
        queued.join(5)
        assert not queued.is_alive()  # queued while the first batch is still being encoded
        release.set()
        sender.join(10)
        channel.flush()
        steps = []
        while len(steps) < 2:
            message = datagram.parse(agent.recv(65536))
            assert not isinstance(message, datagram.Rejection)
            if message.kind == "steps":
                steps += [s.values["step"] for s in message.values["steps"]]
        assert steps == [1, 2]  # in the order queued
    finally:
        release.set()
        channel.close()
        agent.close()


# -- the attacks, replayed ----------------------------------------------------------------


def test_a_step_without_fields_leaves_the_listener_alive(node):
    send(node, {"k": "step", "rank": RANK}, {"k": "step", "rank": RANK, "gen": GEN})
    assert node.counters()[datagram.INVALID] == 2 and node.listener.is_alive()
    send(node, valid(step=1))
    assert node.steps() == {RANK: 1} and node.counters()[ACCEPTED] == 1


def test_bad_durations_are_dropped_and_the_summary_still_publishes(node):
    send(node, *[{"dur": "x"}] * 6, *[valid(step=s, dur="x") for s in range(6)])
    assert node.counters()[datagram.INVALID] == 12
    summary, events = node.collect()
    assert events == [] and summary.ranks == {}
    assert summary.to_dict()["datagrams"][datagram.INVALID] == 12


def test_forged_nan_losses_of_phantom_ranks_or_old_generations_are_no_anomaly(node):
    nan = float("nan")
    send(
        node,
        valid(rank=RANK + 7, loss=nan),
        valid(rank=0, loss=nan),
        valid(gen=GEN - 1, loss=nan),
        valid(gen=GEN + 1, loss=nan),
    )
    counts = node.counters()
    assert counts[FOREIGN_RANK] == 2 and counts[STALE_GENERATION] == 2
    summary, events = node.collect()
    assert events == [] and summary.anomalies == [] and summary.ranks == {}


def test_a_nan_loss_of_a_real_rank_is_still_an_anomaly(node):
    send(node, valid(step=3, loss=2.0), valid(step=4, loss=float("nan")))
    _, events = node.collect()
    assert [(e.type, e.ranks, e.step) for e in events] == [("nan", [RANK], 4)]


def test_a_phantom_heartbeat_does_not_disable_hang_detection(node):
    send(node, valid(step=5), valid("beat", rank=RANK + 50), valid("beat", rank=RANK + 1))
    summary, _ = node.collect()
    assert sorted(summary.ranks) == [str(RANK), str(RANK + 1)]
    send(node, valid(rank=RANK + 1, step=5))
    summary, _ = node.collect()
    views = detectors.rank_views({"nodeY": summary}, GEN, summary.t + 1000)
    assert detectors.hang(views, 10.0) is not None


def test_impossible_compute_times_are_dropped(node):
    bad = [
        valid(step=s, dur=0.1, compute=c)
        for s, c in enumerate([1e9, 0.5, -1.0, float("nan"), float("inf"), "slow"], start=100)
    ]
    send(node, *bad)
    assert node.counters()[datagram.INVALID] == len(bad) and node.steps() == {}


def test_forged_fault_announcements_are_dropped(node):
    send(
        node,
        valid("fault", rank=99),
        valid("fault", gen=0),
        valid("fault", fault={"id": "f0"}),
    )
    assert node.take_fired_faults() == []
    send(node, valid("fault"))
    assert [f["id"] for f, *_ in node.take_fired_faults()] == ["f0"]


def test_timing_still_counts_after_the_warm_up(node):
    send(node, *[valid(step=s, dur=0.1, compute=0.08) for s in range(1, WARMUP_STEPS + 7)])
    assert node.collect()[0].ranks[str(RANK)].compute_s == pytest.approx(0.08)
