"""The `transom` command: run | demo | agent | controller | status | events | report | ckpt-server.

Every refusal or failure exits non-zero with a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from transom.config import ConfigError, JobSpec, parse_nnodes, prepare_run_dir

EXIT_BAD_INPUT = 2
DEFAULT_RUNS = Path("transom-runs")


def _add_store_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument(
        "--store",
        required=required,
        metavar="URL",
        help="etcd to use, e.g. http://10.0.0.1:2379"
        + ("" if required else " (default: start a private etcd on this machine)"),
    )
    p.add_argument(
        "--job-id",
        required=required,
        metavar="J",
        help="job name in etcd; every machine of one job uses the same",
    )


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nnodes",
        default="1",
        metavar="N|MIN:MAX",
        help="active nodes; with MIN:MAX the job goes on with as few as MIN (default 1)",
    )
    p.add_argument(
        "--spares",
        type=int,
        default=0,
        help="hot spare nodes that replace evicted ones (default 0)",
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="restarts allowed for the whole job, counted once per incident (default 3)",
    )
    p.add_argument(
        "--evict-window",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a node whose workers fail twice within this window is evicted (default 300)",
    )
    p.add_argument(
        "--node-ttl",
        type=int,
        default=4,
        metavar="SECONDS",
        help="node lease time-to-live: how long a dead node goes unnoticed at most (default 4)",
    )
    p.add_argument(
        "--join-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long to wait for more than MIN nodes before starting (default 30)",
    )
    p.add_argument(
        "--no-warm-workers",
        dest="warm_workers",
        action="store_false",
        help="start every worker in a fresh interpreter (default: each agent keeps one per "
        "local rank ready with torch imported, which saves seconds on every restart)",
    )
    p.add_argument(
        "--faults",
        metavar="SPEC|FILE",
        help="inject faults (tests, demos): e.g. 'crash@step=40:rank=1,hang@step=80,"
        "slow@step=120:node=node2:factor=2,nan@step=30,log@step=20:rank=0,kill@step=50:node=node1'"
        " or 'random[:count=N][:steps=A-B]'; a file holds one fault a line",
    )
    p.add_argument(
        "--fault-seed",
        type=int,
        default=0,
        help="seed for the ranks (and types and steps with 'random') the fault schedule leaves open "
        "(default 0)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="the leading controller's Prometheus endpoint: 0 picks a free port (shown by "
        "`transom status`), -1 turns it off (default 0)",
    )
    _add_ckpt_args(p)
    p.add_argument("script", help="the training script, run like torchrun runs it")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _size(text: str) -> int:
    from transom.checkpoint.server import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _add_ckpt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ckpt-memory",
        type=_size,
        metavar="SIZE",
        help="memory budget of each node's checkpoint server, e.g. 16G: its own shards, peers' "
        "replicas and reusable buffers (default: half of the node's memory)",
    )
    p.add_argument(
        "--ckpt-storage",
        metavar="DIR",
        help="where checkpoint servers persist shards in the background; shared by all nodes "
        "(default: RUN_DIR/checkpoints)",
    )
    p.add_argument(
        "--ckpt-keep",
        type=int,
        default=3,
        metavar="K",
        help="complete checkpoint steps kept in storage (default 3)",
    )
    p.add_argument(
        "--ckpt-replicas",
        type=int,
        default=1,
        choices=(0, 1),
        help="copies of each shard in another node's memory (default 1)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transom",
        description="Fault-tolerant launcher for PyTorch training: restarts, evicts bad nodes, swaps in spares.",
    )
    parser.add_argument("--log-level", default="warning", help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run a training script fault-tolerantly (like torchrun)",
        description="Start a job: on one machine a private etcd, controllers and "
        "nnodes+spares simulated node agents; with --store, this machine's "
        "agent and a controller candidate of a multi-machine job.",
    )
    _add_store_args(run, required=False)
    run.add_argument(
        "--run-dir", type=Path, help="logs, events and status (default ./transom-runs/JOB_ID)"
    )
    run.add_argument(
        "--local-nodes",
        type=int,
        help="node agents on this machine (default: all nodes without --store, else 1)",
    )
    run.add_argument("--node-id", help="this machine's node name with --store (default: host name)")
    run.add_argument(
        "--host",
        help="address other nodes reach this one at (default: 127.0.0.1 without "
        "--store, else this machine's address)",
    )
    run.add_argument(
        "--refill-spares",
        action="store_true",
        help="simulated nodes only: start a new node whenever one is evicted, as a cluster's "
        "scheduler would, so the pool of spares stays full",
    )
    _add_spec_args(run)

    demo = sub.add_parser(
        "demo",
        help="train the example GPT through a campaign of real faults, then report",
        description="Train examples/train_gpt.py on 4 simulated nodes + 1 hot spare while a "
        "seeded campaign injects a worker crash, a node death, a hang, a NaN and "
        "a slow node; then train it again without faults (torchrun) and write "
        "the report (timeline PNG, goodput, detection and recovery times, and "
        "whether the final weights are bit-identical) to the run directory.",
    )
    demo.add_argument(
        "--steps",
        type=int,
        default=480,
        help="training steps; the faults are spread over them (default 480, a few minutes)",
    )
    demo.add_argument(
        "--seed", type=int, default=0, help="seed of the model, the data and the fault targets"
    )
    demo.add_argument(
        "--run-dir", type=Path, help="where everything goes (default ./transom-runs/JOB_ID)"
    )
    demo.add_argument("--job-id", metavar="J", help="the job's name (default demo-RANDOM)")
    demo.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="skip the fault-free reference run (and so the weights check)",
    )

    agent = sub.add_parser(
        "agent",
        help="run one node agent of a job",
        description="Register this node in the job and run its workers as the controller plans.",
    )
    _add_store_args(agent, required=True)
    agent.add_argument(
        "--node-id", default=socket.gethostname(), help="node name (default: host name)"
    )
    agent.add_argument(
        "--run-dir", type=Path, help="where worker logs go (default ./transom-runs/JOB_ID)"
    )
    agent.add_argument(
        "--host", help="address other nodes reach this one at (default: this machine's)"
    )

    ctl = sub.add_parser(
        "controller",
        help="run a controller candidate of a job",
        description="Stand for leadership of the job and drive its state machine when elected. "
        "With a script it also writes the job spec.",
    )
    _add_store_args(ctl, required=True)
    ctl.add_argument("--candidate-id", default=f"{socket.gethostname()}-{os.getpid()}")
    ctl.add_argument(
        "--nnodes", default="1", metavar="N|MIN:MAX", help="as for run, when writing the spec"
    )
    ctl.add_argument("--spares", type=int, default=0)
    ctl.add_argument("--nproc-per-node", type=int, default=1)
    ctl.add_argument("--max-restarts", type=int, default=3)
    ctl.add_argument("--evict-window", type=float, default=300.0)
    ctl.add_argument("--node-ttl", type=int, default=4)
    ctl.add_argument("--join-timeout", type=float, default=30.0)
    ctl.add_argument("--faults", help="as for run, when writing the spec")
    ctl.add_argument("--fault-seed", type=int, default=0)
    ctl.add_argument("--metrics-port", type=int, default=0)
    _add_ckpt_args(ctl)
    ctl.add_argument("script", nargs="?", help="training script (only to write the spec)")
    ctl.add_argument("script_args", nargs=argparse.REMAINDER)

    for name, what in (
        ("status", "the job's state, generation, nodes and restarts left"),
        ("events", "every decision with its reason and time"),
    ):
        p = sub.add_parser(
            name,
            help=f"show {what}",
            description=f"Show {what}, from etcd "
            "(--store and --job-id) or from a run directory after the job ended.",
        )
        p.add_argument("--store", metavar="URL")
        p.add_argument("--job-id", metavar="J")
        p.add_argument("--run-dir", type=Path, help="a run directory")
        p.add_argument("--json", action="store_true", help="print JSON")

    report = sub.add_parser(
        "report",
        help="write and show the report of a finished run",
        description="Write report.png (timeline), report.md and report.json for a run "
        "directory and print the markdown summary: outcome, goodput, per-fault "
        "detection and recovery times, and the final weights against a "
        "fault-free run when the run directory holds both.",
    )
    report.add_argument(
        "run_dir",
        type=Path,
        nargs="?",
        metavar="RUN_DIR",
        help="the run directory of a finished job",
    )
    report.add_argument(
        "--run-dir",
        type=Path,
        dest="run_dir_option",
        metavar="RUN_DIR",
        help="the same, as an option (like status and events)",
    )
    report.add_argument(
        "--out", type=Path, metavar="DIR", help="where to write the report (default: RUN_DIR)"
    )
    report.add_argument(
        "--json", action="store_true", help="print the JSON summary instead of the markdown"
    )

    sub.add_parser(
        "ckpt-server",
        help="run a node's checkpoint server on its own",
        add_help=False,
        description="Hold checkpoint shards in this node's memory (see `transom ckpt-server --help`).",
    )
    return parser


def spec_from_args(args: argparse.Namespace, check_script: bool = True) -> JobSpec:
    low, high = parse_nnodes(args.nnodes)
    script = os.path.abspath(args.script) if check_script and args.store is None else args.script
    spec = JobSpec(
        script=script,
        script_args=list(args.script_args),
        nnodes_min=low,
        nnodes_max=high,
        spares=args.spares,
        nproc_per_node=args.nproc_per_node,
        max_restarts=args.max_restarts,
        evict_window_s=args.evict_window,
        node_ttl_s=args.node_ttl,
        join_timeout_s=args.join_timeout,
        warm_workers=getattr(args, "warm_workers", True),
        metrics_port=args.metrics_port,
        ckpt_memory_bytes=args.ckpt_memory,
        ckpt_keep=args.ckpt_keep,
        ckpt_replicas=args.ckpt_replicas,
        ckpt_storage=os.path.abspath(args.ckpt_storage) if args.ckpt_storage else None,
    )
    if args.faults:
        from transom.monitor.faults import parse_schedule

        spec.faults = parse_schedule(args.faults, high * args.nproc_per_node, args.fault_seed)
    if getattr(args, "job_id", None):
        spec.job_id = args.job_id
    return spec.validate(check_script=check_script)


def cmd_run(args: argparse.Namespace) -> int:
    from transom.launcher import Launch, Launcher
    from transom.utils.net import host_address

    if args.store is not None and not args.job_id:
        raise ConfigError("--store needs --job-id: every machine of the job must name the same job")
    if args.local_nodes is not None and args.local_nodes < 1:
        raise ConfigError(f"--local-nodes {args.local_nodes}: at least 1")
    spec = spec_from_args(args)
    run_dir = prepare_run_dir(args.run_dir or DEFAULT_RUNS / spec.job_id)
    host = args.host or ("127.0.0.1" if args.store is None else host_address())
    if args.refill_spares and args.store is not None:
        raise ConfigError("--refill-spares starts simulated nodes; it cannot be used with --store")
    launch = Launch(
        spec=spec,
        run_dir=run_dir,
        store_url=args.store,
        local_nodes=args.local_nodes,
        node_prefix=args.node_id,
        host=host,
        refill_spares=args.refill_spares,
    )
    if args.store is None and spec.nnodes_max + spec.spares > 64:
        raise ConfigError(
            f"{spec.nnodes_max + spec.spares} simulated nodes on one machine is too many (64 at most)"
        )
    return Launcher(launch).run()


def cmd_demo(args: argparse.Namespace) -> int:
    from transom.demo import run_demo

    return run_demo(
        steps=args.steps,
        seed=args.seed,
        run_dir=args.run_dir,
        reference=args.reference,
        job_id=args.job_id,
    )


def cmd_agent(args: argparse.Namespace) -> int:
    from transom.control.agent import NodeAgent
    from transom.store import Store
    from transom.utils.net import host_address

    store = Store(args.store, args.job_id)
    run_dir = prepare_run_dir(args.run_dir or DEFAULT_RUNS / args.job_id)
    return NodeAgent(store, args.node_id, run_dir, host=args.host or host_address()).run()


def cmd_controller(args: argparse.Namespace) -> int:
    from transom.control.controller import Controller
    from transom.store import Store

    store = Store(args.store, args.job_id)
    if args.script:
        store.create("spec", spec_from_args(args).to_dict())
    return Controller(store, args.candidate_id).run()


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from transom.store import Store
    from transom.view import (
        format_event,
        read_events,
        read_snapshot,
        render_status,
        snapshot,
        status_summary,
    )

    if args.store and args.job_id:
        store = Store(args.store, args.job_id)
        store.wait_healthy(3.0)
        if store.get("spec") is None:
            raise ConfigError(f"no job {args.job_id} in etcd at {args.store}")
        if args.command == "events":
            data = read_events(store=store)
        else:
            data = status_summary(snapshot(store))
    elif args.run_dir:
        if not Path(args.run_dir).is_dir():
            raise ConfigError(f"run directory {args.run_dir} does not exist")
        snap = read_snapshot(args.run_dir)
        if snap is None:
            raise ConfigError(f"{args.run_dir} holds no status.json: not a transom run directory")
        data = (
            read_events(run_dir=args.run_dir) if args.command == "events" else status_summary(snap)
        )
    else:
        raise ConfigError("give --run-dir DIR, or --store URL and --job-id J")
    if args.json:
        print(json.dumps(data, indent=1))
    elif args.command == "events":
        for event in data:
            print(format_event(event))
    else:
        Console().print(render_status(data))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from transom.report import write_report

    run_dir = args.run_dir or args.run_dir_option
    if run_dir is None:
        raise ConfigError("give the run directory: transom report RUN_DIR")
    try:
        summary = write_report(run_dir, args.out)
    except OSError as e:
        raise ConfigError(f"report of {run_dir}: {e}") from None
    print(
        json.dumps(summary, indent=1) + "\n"
        if args.json
        else Path(summary["files"]["markdown"]).read_text(),
        end="",
    )
    return 0


COMMANDS = {
    "run": cmd_run,
    "demo": cmd_demo,
    "agent": cmd_agent,
    "controller": cmd_controller,
    "status": cmd_status,
    "events": cmd_status,
    "report": cmd_report,
}


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `transom events | head` ends quietly
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ckpt-server"]:
        from transom.checkpoint.server import main as ckpt_server

        return ckpt_server(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    from transom.store import StoreError

    try:
        return COMMANDS[args.command](args)
    except (ConfigError, StoreError) as e:
        print(f"transom: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
