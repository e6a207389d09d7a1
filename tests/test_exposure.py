"""Least exposure: every port of a job listens only where it must (loopback on one machine).

Fast tests: the one rule for a node's bind address (utils/net.py), gloo's interface in the
workers' environment, the checkpoint server and the metrics endpoint refusing or avoiding
wildcards. The slow test runs a single-machine job and lists every listening TCP/UDP socket of
its processes (what `ss -ltunp` shows) while it trains.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import urllib.request
from pathlib import Path

import psutil
import pytest
from conftest import job_processes, wait_for
from prometheus_client import generate_latest

from transom.checkpoint import server_options
from transom.common.records import JobRecord, MonitorSummary, RankSummary
from transom.common.states import JobState
from transom.control.store_host import TorchStore
from transom.control.workers import GLOO_IFNAME, Assignment, worker_env
from transom.monitor.exporter import MonitorExporter
from transom.utils.net import (
    bind_address,
    interface_of,
    is_loopback,
    listening_socket,
)
from transom.utils.procs import process_tree

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
SMALL = [
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "8",
    "--ckpt-every",
    "3",
    "--log-every",
    "1",
    "--steps",
    "40",
    "--step-delay",
    "0.15",
]


# -- the rule -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "store_url, host, expected",
    [
        ("http://127.0.0.1:2379", "10.1.2.3", "127.0.0.1"),  # store on loopback: one machine
        ("https://localhost:2379", "node7.cluster", "127.0.0.1"),
        ("https://[::1]:2379", "10.1.2.3", "127.0.0.1"),
        ("https://etcd.cluster:2379", "10.1.2.3", "10.1.2.3"),  # several machines: the node's
        ("http://10.0.0.1:2379", "node7.cluster", "node7.cluster"),
        ("https://10.0.0.1:2379", "127.0.0.1", "127.0.0.1"),  # told loopback: stays loopback
    ],
)
def test_bind_address_is_loopback_on_one_machine_else_the_nodes_address(store_url, host, expected):
    assert bind_address(store_url, host) == expected


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", ""])
def test_bind_address_refuses_a_wildcard(host):
    with pytest.raises(ValueError, match="wildcard"):
        bind_address("https://10.0.0.1:2379", host)


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("127.5.5.5") and is_loopback("::1")
    assert is_loopback("localhost") and is_loopback("[::1]")
    assert not is_loopback("10.0.0.1") and not is_loopback("0.0.0.0") and not is_loopback(None)
    assert not is_loopback("node7.cluster")


def test_interface_of_names_the_interface_carrying_an_address():
    loopback = interface_of("127.0.0.1")
    assert loopback is not None
    assert any(a.address == "127.0.0.1" for a in psutil.net_if_addrs()[loopback])
    assert interface_of("no-such-host.invalid") is None


def test_listening_socket_listens_on_the_given_address_only():
    sock = listening_socket("127.0.0.1")
    try:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
        with socket.create_connection((host, port), timeout=5):
            pass  # queued in the backlog: nobody has to accept yet
    finally:
        sock.close()


# -- where the workers' gloo listens ------------------------------------------------------------
def _assignment(host: str) -> Assignment:
    return Assignment(
        job_id="job",
        node_id="node0",
        generation=1,
        restart_count=0,
        max_restarts=3,
        group_rank=0,
        group_world_size=2,
        nproc_per_node=1,
        master_addr=host,
        master_port=29500,
        host=host,
    )


def test_workers_gloo_listens_on_the_nodes_interface(monkeypatch):
    monkeypatch.delenv(GLOO_IFNAME, raising=False)
    env = worker_env(_assignment("127.0.0.1"), 0, {})
    assert env[GLOO_IFNAME] == interface_of("127.0.0.1")


def test_an_operators_gloo_interface_wins(monkeypatch):
    monkeypatch.setenv(GLOO_IFNAME, "ib0")
    assert worker_env(_assignment("127.0.0.1"), 0, {})[GLOO_IFNAME] == "ib0"


def test_no_gloo_interface_when_no_interface_carries_the_address(monkeypatch):
    monkeypatch.delenv(GLOO_IFNAME, raising=False)
    assert GLOO_IFNAME not in worker_env(_assignment("no-such-host.invalid"), 0, {})


@pytest.mark.integration
def test_the_generations_torch_store_is_served_on_the_nodes_address_by_its_host_only(tmp_path):
    """The agent never imports torch: it makes the store's socket and a host process serves it
    (started cold here; forked from the warm interpreter in a job)."""
    import datetime

    from torch.distributed import TCPStore

    store = TorchStore("127.0.0.1")
    clients: list[TCPStore] = []
    early = threading.Thread(
        target=lambda: clients.append(
            TCPStore(
                "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=60)
            )
        )
    )
    handoff = os.path.join(store._dir, "handoff.sock")
    intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        early.start()  # a rank that connects before the store is up waits in its backlog
        intruder.connect(handoff)  # first in line, but not the host: it gets no socket
        store.start(None, tmp_path / "torch-store.log")
        early.join(90)
        client = clients[0]
        client.set("rendezvous", "here")
        assert client.get("rendezvous") == b"here"
        intruder.settimeout(30)
        _message, fds, _flags, _addr = socket.recv_fds(intruder, 16, 1)
        assert fds == []
        assert store.proc is not None
        served = [s for s in _listening(psutil.Process(store.proc.pid)) if s[2] == store.port]
        assert served == [("tcp", "127.0.0.1", store.port)]
        assert not [s for s in _listening(psutil.Process()) if s[2] == store.port]  # handed over
        del client, clients[:]
    finally:
        intruder.close()
        store.close()
    assert store.proc.poll() is not None  # the host ends with its generation
    assert not os.path.exists(handoff)


def test_every_rank_is_a_client_of_the_agents_torch_store():
    env = worker_env(_assignment("127.0.0.1"), 0, {})
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"


# -- the checkpoint server and the metrics endpoint ---------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_checkpoint_server_refuses_a_wildcard_host(host, tmp_path):
    args = server_options.build_parser().parse_args(
        ["--host", host, "--shm-dir", str(tmp_path), "--memory", "1M"]
    )
    with pytest.raises(ValueError, match="every interface"):
        server_options.from_args(args, environ={})


def test_checkpoint_server_listens_on_loopback_by_default(tmp_path):
    args = server_options.build_parser().parse_args(["--shm-dir", str(tmp_path), "--memory", "1M"])
    assert server_options.from_args(args, environ={}).host == "127.0.0.1"


def test_metrics_endpoint_listens_where_it_is_told():
    exporter = MonitorExporter()
    exporter.update(JobRecord.new(0.0), {})
    port = exporter.serve(0, "127.0.0.1")
    try:
        assert port is not None
        server = exporter._server
        assert server is not None and server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert b"transom_generation" in reply.read()
    finally:
        exporter.stop()


def test_metrics_are_built_from_the_newest_update_when_read():
    """The controller hands over the job and summaries each tick; the gauges are what the
    newest of them say when the endpoint is read (ranks of an older generation left out)."""
    exporter = MonitorExporter()
    job = JobRecord.new(0.0)
    job.state, job.generation, job.restarts_used = JobState.RUNNING, 3, 1

    def summary(node: str, generation: int, step: int) -> MonitorSummary:
        ranks = {"0": RankSummary(step=step, step_s=0.5, compute_s=0.4)}
        return MonitorSummary(node, generation, 0.0, ranks=ranks)

    exporter.update(job, {"n1": summary("n1", 3, 10), "n2": summary("n2", 2, 99)})
    exporter.update(job, {"n1": summary("n1", 3, 12), "n2": summary("n2", 2, 99)})
    text = generate_latest(exporter.registry).decode()
    assert 'transom_job_state{state="RUNNING"} 1.0' in text
    assert 'transom_job_state{state="FAILED"} 0.0' in text
    assert "transom_generation 3.0" in text and "transom_restarts_used 1.0" in text
    assert 'transom_rank_step{node="n1",rank="0"} 12.0' in text  # the newest update's
    assert 'transom_rank_compute_seconds{node="n1",rank="0"} 0.4' in text
    assert 'transom_node_step_seconds{node="n1"} 0.5' in text
    assert 'node="n2"' not in text  # its summary is of generation 2
    assert "transom_rank_tokens_per_second{" not in text  # no rank reported any


# -- a running single-machine job ---------------------------------------------------------------
def _listening(proc: psutil.Process) -> list[tuple[str, str, int]]:
    """(kind, address, port) of every socket of `proc` that accepts connections or datagrams
    from anyone: TCP in LISTEN, UDP bound to a port and not connected (what `ss -ltun` lists)."""
    found = []
    try:
        connections = proc.net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []
    for c in connections:
        if c.type == socket.SOCK_STREAM and c.status == psutil.CONN_LISTEN:
            found.append(("tcp", c.laddr.ip, c.laddr.port))
        elif c.type == socket.SOCK_DGRAM and c.laddr and c.laddr.port and not c.raddr:
            found.append(("udp", c.laddr.ip, c.laddr.port))
    return found


def _on_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _job_sockets(job) -> dict[int, tuple[str, list[tuple[str, str, int]]]]:
    """pid -> (command line, listening sockets) for every process of the job, children included."""
    procs = {p.pid: p for p in process_tree(job.process.pid)}
    for p in job_processes(job.job_id) + job_processes(str(job.run_dir)):
        for q in process_tree(p.pid):
            procs.setdefault(q.pid, q)
    out = {}
    for pid, p in procs.items():
        try:
            out[pid] = (" ".join(p.cmdline()), _listening(p))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return out


@pytest.mark.slow
def test_a_single_machine_job_listens_on_loopback_only(start_job):
    job = start_job("--nnodes", "2", "--spares", "1", "--nproc-per-node", "1", SCRIPT, *SMALL)
    # Training, a checkpoint replicated to a peer, and the metrics endpoint up: every kind of
    # port the job has is open by then.
    wait_for(lambda: "step 6 " in job.log_text(), 120, "training to reach step 6")
    wait_for(
        lambda: any(e["kind"] == "checkpoint" and e.get("tier") == "peer" for e in job.events()),
        60,
        "a checkpoint replicated to a peer",
    )
    url = wait_for(
        lambda: (job.status().get("exporter") or {}).get("url"), 30, "the metrics endpoint"
    )
    workers = [wait_for(lambda r=r: job.worker(r), 10, f"the rank {r} worker") for r in (0, 1)]

    sockets = _job_sockets(job)
    exposed = [
        (cmdline, s) for cmdline, found in sockets.values() for s in found if not _on_loopback(s[1])
    ]
    assert not exposed, f"listening on a non-loopback address: {exposed}"

    # The check saw the job's ports (it cannot pass by seeing nothing).
    ports = {s[2] for _, found in sockets.values() for s in found}
    assert int(url.rsplit(":", 1)[1].split("/")[0]) in ports, "the metrics endpoint"
    servers = [f for cmdline, f in sockets.values() if "transom.checkpoint.server" in cmdline]
    assert len(servers) == 3 and all(any(s[0] == "tcp" for s in f) for f in servers), servers
    etcd = [f for cmdline, f in sockets.values() if "etcd" in cmdline.split()[0]]
    assert etcd and etcd[0], "the embedded etcd's ports"
    for w in workers:
        _, found = sockets.get(w.pid, ("", []))
        assert any(s[0] == "tcp" for s in found), f"gloo's listener in worker {w.pid}"

    assert job.wait() == 0, job.output
