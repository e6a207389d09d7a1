"""Fuzzing the monitor channel: at least 10,000 random and crafted datagrams at a live NodeMonitor
(its listener survives, counts every one, and raises no anomaly), then at the monitor sockets of
a real two-node job during training, together with 10,000 random and crafted frames at its
checkpoint servers' peer ports (the job ends as a fault-free run does, bit-identical)."""

from __future__ import annotations

import json
import random
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO, job_processes, wait_for
from test_checkpoint_peer import _frames, _send_frame

from transom.checkpoint import flatten, shard_format
from transom.common import env
from transom.faults import MockNvml
from transom.monitor import datagram
from transom.monitor.channel import SOCKET_NAME, dir_prefix
from transom.monitor.node import ACCEPTED, COUNTERS, FOREIGN_RANK, STALE_GENERATION, NodeMonitor
from transom.report.weights import compare_files

FUZZ_COUNT = 10_000
NAN, INF = float("nan"), float("inf")
# Values that break a field of the schema, by the field's type.
BAD_INTS = [None, -1, 1.5, "3", True, [], {}, 10**30, NAN, INF, -(10**20)]
BAD_SECONDS = [-1.0, NAN, INF, -INF, 1e300, "x", True, [1.0], {"s": 1}]
BAD_NAMES = [1, 2.5, True, {"a": 1}, "x" * 300, "line\nbreak", "\x00"]


def _template(kind: str, rank: int, generation: int, rng: random.Random) -> dict:
    step = rng.randrange(0, 10**6)
    values = {
        "step": {"step": step, "dur": 0.2, "comm": 0.05, "compute": 0.15, "loss": 2.0},
        "steps": {"steps": [{"t": 1.7e9, "step": step, "dur": 0.2, "loss": 2.0}]},
        "beat": {"step": step, "phase": None},
        "phase": {"step": step, "phase": "checkpoint"},
        "fault": {"step": step, "fault": {"id": "f9", "type": "nan", "step": 1}},
        "fingerprint": {"step": step, "fp": "9f2c4e1a07b3d865"},
    }[kind]
    return {"k": kind, "rank": rank, "gen": generation, "t": 1.7e9, **values}


def _broken(message: dict, rng: random.Random) -> dict:
    """`message` with one field given a value its schema refuses."""
    kind = message["k"]
    name = rng.choice([*datagram.COMMON, *datagram.SCHEMA[kind], "k"])
    spec = datagram.COMMON.get(name) or datagram.SCHEMA[kind].get(name)
    if spec is not None and spec.required and rng.random() < 0.2:
        return {k: v for k, v in message.items() if k != name}  # a required field missing
    if spec is None:  # the kind
        bad = rng.choice(["", "stepz", "STEP", None, 3, ["step"], "x" * 100])
    elif spec.type == "fault":
        bad = rng.choice(["nan", 7, [], {"id": "f"}, {"type": "nan"}, {"id": [], "type": "x"}])
    elif spec.type == "int":
        bad = rng.choice(BAD_INTS[1:] if spec.nullable else BAD_INTS)
    elif spec.type == "float" and spec.finite:
        bad = rng.choice(BAD_SECONDS)
    elif spec.type == "float":  # loss: anything but a number or null
        bad = rng.choice(["nan", "inf", True, [2.0], {"v": 1}])
    elif spec.type == "names":
        bad = rng.choice([*BAD_NAMES, ["a"] * 20, [1, 2], ["x" * 300], "checkpoint"])
    else:
        bad = rng.choice([*BAD_NAMES, ["a"]])
    return message | {name: bad}


def fuzz_datagrams(n: int, ranks: list[int], generation: int, seed: int) -> list[tuple[bytes, str]]:
    """`n` datagrams none of which a monitor of `generation` expecting `ranks` may accept, each
    with the counter it must land in."""
    rng = random.Random(seed)
    out: list[tuple[bytes, str]] = []
    crafted = [  # the issue's
        (b'{"k":"step","rank":%d}' % ranks[0], datagram.INVALID),
        (b'{"dur":"x"}', datagram.INVALID),
        (b'{"k":"step","rank":0,"step":1,"dur":"x"}', datagram.INVALID),
    ]
    while len(out) < n:
        kind = rng.choice(sorted(datagram.KINDS))
        legit = _template(kind, rng.choice(ranks), generation, rng)
        choice = rng.randrange(10)
        if choice == 0:  # random bytes
            data = rng.randbytes(rng.randrange(0, 300))
            out.append((data, _expected(data)))
        elif choice == 1:  # truncated JSON
            text = json.dumps(legit).encode()
            out.append((text[: rng.randrange(0, len(text) - 1)], datagram.NOT_JSON))
        elif choice in (2, 3, 4):  # one field of the wrong type, null, missing or out of range
            out.append((json.dumps(_broken(legit, rng)).encode(), datagram.INVALID))
        elif choice == 5:  # a phantom rank, a NaN loss or a fault among them
            phantom = rng.choice([r for r in range(64) if r not in ranks] + [10**5])
            message = legit | {"rank": phantom}
            if kind == "step" and rng.random() < 0.5:
                message["loss"] = rng.choice([NAN, INF, 1e30])
            out.append((json.dumps(message).encode(), FOREIGN_RANK))
        elif choice == 6:  # an old (or future) generation
            message = legit | {
                "gen": rng.choice([g for g in range(generation + 3) if g != generation])
            }
            out.append((json.dumps(message).encode(), STALE_GENERATION))
        elif choice == 7:  # huge
            if rng.random() < 0.5:
                message = legit | {"pad": "x" * rng.randrange(datagram.MAX_BYTES, 60_000)}
                out.append((json.dumps(message).encode(), datagram.OVERSIZE))
            else:  # each power of ten past the field's maximum
                name, low = rng.choice([("rank", 7), ("gen", 10), ("step", 16)])
                message = legit | {name: 10 ** rng.randrange(low, 40)}
                out.append((json.dumps(message).encode(), datagram.INVALID))
        elif choice == 8:  # not an object, or nested past the recursion limit
            data = rng.choice([b"[]", b"null", b"1", b'"step"', b"[" * 3000, b"{" * 2000])
            out.append((data, datagram.NOT_JSON))
        else:
            out.append(crafted[rng.randrange(len(crafted))])
    return out


def _expected(data: bytes) -> str:
    """The counter of random bytes (nearly always not JSON; a few bytes may be a JSON number)."""
    parsed = datagram.parse(data)
    assert isinstance(parsed, datagram.Rejection)
    return parsed.reason


def send_all(path: Path, datagrams: list[tuple[bytes, str]]) -> None:
    """Send as fast as the listener takes them (a blocking socket waits while its queue is full)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.settimeout(30)
        for data, _ in datagrams:
            s.sendto(data, str(path))


def expected_counts(datagrams: list[tuple[bytes, str]]) -> dict[str, int]:
    counts = dict.fromkeys(COUNTERS, 0)
    for _, reason in datagrams:
        counts[reason] += 1
    return counts


def test_ten_thousand_fuzzed_datagrams_are_counted_and_dropped():
    monitor = NodeMonitor("fuzz", nvml=MockNvml(), scope="fuzz-test")
    try:
        monitor.new_generation(3)
        monitor.expect_ranks([4, 5])
        datagrams = fuzz_datagrams(FUZZ_COUNT, [4, 5], 3, seed=12)
        send_all(monitor.socket_path, datagrams)
        wait_for(lambda: sum(monitor.counters().values()) == len(datagrams), 60, "every datagram")
        assert monitor.listener.is_alive()
        assert monitor.counters() == expected_counts(datagrams)
        dropped = [datagram.OVERSIZE, datagram.NOT_JSON, datagram.INVALID]
        assert all(monitor.counters()[r] > 100 for r in [*dropped, STALE_GENERATION, FOREIGN_RANK])
        monitor.check({}, {})
        summary, events = monitor.collect()
        assert events == [] and summary.anomalies == [] and summary.ranks == {}
        assert monitor.take_fired_faults() == []
        assert summary.to_dict()["datagrams"] == expected_counts(datagrams)
        # The channel still works, and a real rank's NaN loss is still an anomaly.
        real = [
            datagram.encode("step", 4, 3, 1.7e9, step=10, loss=2.0),
            datagram.encode("step", 5, 3, 1.7e9, step=10, loss=NAN),
        ]
        send_all(monitor.socket_path, [(d, ACCEPTED) for d in real])
        wait_for(lambda: monitor.counters()[ACCEPTED] == 2, 10, "the real datagrams")
        _, events = monitor.collect()
        assert [(e.type, e.ranks) for e in events] == [("nan", [5])]
    finally:
        monitor.close()


# -- a real job ---------------------------------------------------------------------------------

TRAIN = str(REPO / "examples" / "train_gpt.py")


def _sockets(run_dir: Path, nodes: list[str]) -> dict[str, Path] | None:
    found = {}
    for node in nodes:
        prefix = dir_prefix(str(run_dir.resolve()), node)
        paths = sorted(Path(tempfile.gettempdir()).glob(f"{prefix}*/{SOCKET_NAME}"))
        if len(paths) != 1:
            return None
        found[node] = paths[0]
    return found


def _a_load_warning(event: dict) -> bool:
    """A slowdown warning (throughput drop, or a straggler only warned about, never acted on):
    the fuzzer's datagrams load the machine, and the node it fuzzes, while the job trains."""
    kind_of_anomaly = {"anomaly": event.get("type"), "warning": event.get("anomaly_type")}
    slowdown = kind_of_anomaly.get(event["kind"]) in ("throughput_drop", "straggler")
    return slowdown and event.get("severity", "warning") == "warning"


def _peer_ports(job_id: str) -> list[tuple[tuple[str, int], bytes, int]] | None:
    """(address, the job's checkpoint secret, pid) of each checkpoint server's peer port."""
    found = []
    for proc in job_processes(job_id):
        try:
            if "transom.checkpoint.server" not in " ".join(proc.cmdline()):
                continue
            listening = [c.laddr for c in proc.net_connections("tcp") if c.status == "LISTEN"]
            secret = proc.environ()[env.CKPT_SECRET].encode()
        except (psutil.Error, KeyError):
            return None
        if len(listening) != 1:
            return None
        found.append(((listening[0].ip, listening[0].port), secret, proc.pid))
    return found if len(found) == 2 else None


def _fuzz_peer_ports(ports: list[tuple[tuple[str, int], bytes, int]], count: int) -> None:
    """`count` random and crafted frames (as an outsider, and after a valid handshake)."""
    plan = flatten.plan_state({"w": torch.zeros(16)}, 9, 0, 2)
    checksums = shard_format.checksum_data(memoryview(bytes(plan.data_len)))
    header = plan.header.with_chunks(checksums)
    frames = _frames(
        random.Random(5), count, (header.to_json(), shard_format.encode_header(header))
    )
    with ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(_send_frame, ports[i % len(ports)][0], *frame, ports[i % len(ports)][1])
            for i, frame in enumerate(frames)
        ]
        for future in futures:
            future.result()


@pytest.mark.slow
def test_a_job_fuzzed_at_its_monitor_sockets_ends_as_a_fault_free_run(start_job, tmp_path):
    args = ["--nnodes", "2", "--nproc-per-node", "1", TRAIN, "--steps", "400", "--seed", "3"]
    args += ["--ckpt-every", "20", "--step-delay", "0.05", "--log-every", "5"]
    job = start_job(*args, "--save-final", str(tmp_path / "fuzzed.pt"))
    sockets = wait_for(lambda: _sockets(job.run_dir, ["node0", "node1"]), 60, "the sockets")
    ports = wait_for(lambda: _peer_ports(job.job_id), 60, "the checkpoint peer ports")
    wait_for(lambda: "step 10 " in job.log_text(), 120, "training to reach step 10")
    _fuzz_peer_ports(ports, FUZZ_COUNT)
    assert _peer_ports(job.job_id) == ports  # every checkpoint server lives on, unrestarted
    sent = {}
    for i, (node, path) in enumerate(sorted(sockets.items())):
        # node i runs rank i in generation 1; the other node's rank is a foreign rank here
        sent[node] = fuzz_datagrams(FUZZ_COUNT // 2, [i], 1, seed=i)
        send_all(path, sent[node])
    assert job.process.poll() is None and "done step=" not in job.log_text(), "fuzzed too late"

    def counted() -> bool:
        monitor = job.status().get("monitor", {})
        for node, datagrams in sent.items():
            counts = monitor.get(node, {}).get("datagrams", {})
            expected = expected_counts(datagrams)
            if any(counts.get(r, 0) != expected[r] for r in COUNTERS if r != ACCEPTED):
                return False
        return True

    wait_for(counted, 60, "the agents' summaries to count the fuzzed datagrams")
    assert job.wait(timeout=300) == 0, job.output
    # The fuzzing itself takes the CPU of a small machine from the job: an honest slowdown warning
    # may come (not acted on); anything else (a fault, a decision, a restart) is noise.
    noise = [
        (e["kind"], e.get("message"))
        for e in job.events()
        if e["kind"] in ("anomaly", "warning", "decision", "incident", "rollback", "failed")
        and not _a_load_warning(e)
    ]
    assert noise == []
    assert job.status()["job"]["generation"] == 1  # no restart
    reference = start_job(*args, "--save-final", str(tmp_path / "reference.pt"))
    assert reference.wait(timeout=300) == 0, reference.output
    weights = compare_files(tmp_path / "fuzzed.pt", tmp_path / "reference.pt")
    assert weights["identical"], weights
