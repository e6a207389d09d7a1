"""The `transom` command: run | demo | agent | controller | status | events | report | ckpt-server.

Every refusal or failure exits non-zero with a one-line reason on stderr; every id given on the
command line is checked with `transom.common.names.check_id` before a command runs. The job's
options (`run`, `controller`) come from `JobSpec` (`transom.job_spec.add_job_options`): this module
must never define a job option or a default of its own. How every command reaches etcd
(`--store` and its TLS files) is `transom.store.access`'s to define.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from transom.common import files, keys
from transom.common.fault_spec import Fault
from transom.common.names import BadId, check_id
from transom.control.candidacy import DEFAULT_CANDIDATES
from transom.job_spec import (
    MAX_SIMULATED_NODES,
    ConfigError,
    JobSpec,
    add_job_options,
    prepare_run_dir,
)
from transom.store import access as store_access
from transom.store.access import StoreAccess
from transom.utils.net import WILDCARDS

EXIT_BAD_INPUT = 2
DEFAULT_RUNS = Path("transom-runs")


def _add_store_args(p: argparse.ArgumentParser, required: bool) -> None:
    store_access.add_store_options(
        p, required, "" if required else "default: start a private etcd on this machine"
    )
    p.add_argument(
        "--job-id",
        required=required,
        metavar="J",
        help="job name in etcd; every machine of one job uses the same",
    )


def _add_script_args(p: argparse.ArgumentParser, required: bool) -> None:
    if required:
        p.add_argument("script", help="the training script, run like torchrun runs it")
    else:
        p.add_argument("script", nargs="?", help="the training script (only to write the job spec)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transom",
        description="Fault-tolerant launcher for PyTorch training: restarts, evicts bad nodes, "
        "swaps in spares.",
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
    run.add_argument(
        "--controllers",
        type=int,
        metavar="N",
        help=f"the job's controller candidates (default: {DEFAULT_CANDIDATES} with --store, run "
        "by the first live nodes in registration order, the next promoted when one leaves; 2 "
        "without --store, on this machine); give every machine of a job the same N",
    )
    run.add_argument(
        "--no-mirror",
        dest="mirror",
        action="store_false",
        help="with --store: keep no status.json, events.jsonl or progress.jsonl here and print "
        "no events, following only the job's state; on a large job one machine mirrors the "
        "job and the others need not make etcd send them every node's updates (under Slurm "
        "the first node mirrors)",
    )
    run.add_argument("--node-id", help="this machine's node name with --store (default: host name)")
    run.add_argument(
        "--host",
        help="address other nodes reach this one at (default: 127.0.0.1 without "
        "--store, else this machine's address)",
    )
    run.add_argument(
        "--slurm-drain",
        action="store_true",
        help="in a Slurm job: drain every node the job evicts (scontrol update state=drain)",
    )
    run.add_argument(
        "--refill-spares",
        action="store_true",
        help="simulated nodes only: start a new node whenever one is evicted or taken for dead, "
        "as a cluster's scheduler would, so the pool of spares stays full (while a restart "
        "starts its workers, once they train)",
    )
    run.add_argument(
        "--fresh",
        action="store_true",
        help="start over instead of resuming from the checkpoints --ckpt-storage holds (by "
        "default a rerun resumes from the newest complete step there, whatever its job id); "
        "the old steps stay until this job has saved newer ones",
    )
    run.add_argument(
        "--discard-storage",
        action="store_true",
        help="with --fresh: also delete every checkpoint step in --ckpt-storage first",
    )
    add_job_options(run)
    _add_script_args(run, required=True)

    demo = sub.add_parser(
        "demo",
        help="train the example GPT through a campaign of real faults, then report",
        description="Train the example GPT (transom/workloads/train_gpt.py) on 4 simulated "
        "nodes + 1 hot spare while a "
        "seeded campaign injects a worker crash, a node death, a hang, a silent "
        "bit flip in one rank's parameters, a NaN and a slow node; then train it "
        "again without faults (torchrun) and write "
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
    ctl.add_argument(
        "--candidate-id",
        default=f"{socket.gethostname()}-{os.getpid()}",
        help="this candidate's name in the leader election (default: HOST-PID)",
    )
    add_job_options(ctl)
    _add_script_args(ctl, required=False)

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
        store_access.add_store_options(p, required=False)
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
        description="Hold checkpoint shards in this node's memory "
        "(see `transom ckpt-server --help`).",
    )
    return parser


def _resolve_faults(text: str, world_size: int, seed: int) -> list[Fault]:
    from transom.faults import parse_schedule

    return parse_schedule(text, world_size, seed)


def spec_from_args(args: argparse.Namespace, check_script: bool = True) -> JobSpec:
    """The validated job spec of `run` or `controller` (options from `add_job_options`)."""
    script = os.path.abspath(args.script) if check_script and args.store is None else args.script
    fields: dict[str, Any] = {"script": script, "script_args": list(args.script_args)}
    if args.job_id:
        fields["job_id"] = args.job_id
    spec = JobSpec.from_args(args, resolve_faults=_resolve_faults, **fields)
    return spec.validate(check_script=check_script)


# The options that name a job, node or controller candidate; every command checks them.
ID_OPTIONS = {"job_id": "--job-id", "node_id": "--node-id", "candidate_id": "--candidate-id"}


def check_ids(args: argparse.Namespace) -> None:
    """ConfigError naming the first id option whose value is not a valid id, or a wildcard
    `--host` (a node's address is what its peers connect to; nothing may listen everywhere)."""
    for dest, flag in ID_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is not None:
            try:
                check_id(flag, value)
            except BadId as e:
                raise ConfigError(str(e)) from None
    host = getattr(args, "host", None)
    if host is not None and host.strip("[]") in WILDCARDS:
        raise ConfigError(
            f"--host {host!r} is a wildcard address: give the address other nodes reach this one at"
        )


def _store(args: argparse.Namespace) -> StoreAccess | None:
    """How this command reaches etcd (None without --store); plain http to another machine is
    warned about on stderr, in one line."""
    access = store_access.from_args(args)
    warning = access.warning() if access is not None else None
    if warning:
        print(f"transom: {warning}", file=sys.stderr)
    return access


def _required_store(args: argparse.Namespace) -> StoreAccess:
    access = _store(args)
    if access is None:  # argparse makes --store required where this is called
        raise ConfigError(f"{store_access.FLAG_URL} is required")
    return access


def cmd_run(args: argparse.Namespace) -> int:
    from transom.cluster import slurm, slurm_run
    from transom.launcher import Launch, Launcher
    from transom.utils.net import host_address

    allocation = slurm.detect(os.environ)  # inside a Slurm step: job and nodes come from Slurm
    args.job_id = args.job_id or (allocation.job_id if allocation else None)
    if args.store is not None and not args.job_id:
        raise ConfigError("--store needs --job-id: every machine of the job must name the same job")
    if args.local_nodes is not None and args.local_nodes < 1:
        raise ConfigError(f"--local-nodes {args.local_nodes}: at least 1")
    if args.controllers is not None and args.controllers < 1:
        raise ConfigError(f"--controllers {args.controllers}: at least 1 (a job needs a leader)")
    if not args.mirror and args.store is None:
        raise ConfigError("--no-mirror is for one machine of a multi-machine job (--store)")
    if args.discard_storage and not args.fresh:
        raise ConfigError("--discard-storage deletes checkpoints only with --fresh")
    store = _store(args)
    spec = spec_from_args(args)
    if allocation is not None:
        return slurm_run.run_args(allocation, spec, store, args, DEFAULT_RUNS)
    if args.store is None and spec.nnodes_max + spec.spares > MAX_SIMULATED_NODES:
        raise ConfigError(
            f"{spec.nnodes_max + spec.spares} simulated nodes on one machine is too many "
            f"({MAX_SIMULATED_NODES} at most)"
        )
    if args.refill_spares and args.store is not None:
        raise ConfigError("--refill-spares starts simulated nodes; it cannot be used with --store")
    run_dir = prepare_run_dir(args.run_dir or DEFAULT_RUNS / spec.job_id)
    host = args.host or ("127.0.0.1" if args.store is None else host_address())
    launch = Launch(
        spec=spec,
        run_dir=run_dir,
        store=store,
        local_nodes=args.local_nodes,
        controllers=args.controllers,
        node_prefix=args.node_id,
        host=host,
        refill_spares=args.refill_spares,
        mirror=args.mirror,
        fresh=args.fresh,
        discard_storage=args.discard_storage,
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

    store = Store(_required_store(args), args.job_id)
    run_dir = prepare_run_dir(args.run_dir or DEFAULT_RUNS / args.job_id)
    return NodeAgent(store, args.node_id, run_dir, host=args.host or host_address()).run()


def cmd_controller(args: argparse.Namespace) -> int:
    from transom.control.controller import Controller
    from transom.store import Store

    store = Store(_required_store(args), args.job_id)
    if args.script:
        store.create(keys.SPEC, spec_from_args(args).to_dict())
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

    events: list[dict] = []
    summary: dict = {}
    access = _store(args)
    if access is not None and args.job_id:
        store = Store(access, args.job_id)
        store.wait_healthy(3.0)
        if store.get(keys.SPEC) is None:
            raise ConfigError(f"no job {args.job_id} in etcd at {args.store}")
        if args.command == "events":
            events = read_events(store=store)
        else:
            summary = status_summary(snapshot(store))
    elif args.run_dir:
        if not Path(args.run_dir).is_dir():
            raise ConfigError(f"run directory {args.run_dir} does not exist")
        snap = read_snapshot(args.run_dir)
        if snap is None:
            raise ConfigError(
                f"{args.run_dir} holds no {files.STATUS}: not a transom run directory, or "
                + files.NOT_MIRRORED
            )
        if args.command == "events":
            events = read_events(run_dir=args.run_dir)
        else:
            summary = status_summary(snap)
    else:
        raise ConfigError("give --run-dir DIR, or --store URL and --job-id J")
    if args.command == "events":
        if args.json:
            print(json.dumps(events, indent=1))
        else:
            for event in events:
                print(format_event(event))
    elif args.json:
        print(json.dumps(summary, indent=1))
    else:
        Console().print(render_status(summary))
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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ckpt-server"]:
        from transom.checkpoint.server import main as ckpt_server

        return ckpt_server(argv[1:])
    args = build_parser().parse_args(argv)
    from transom.cluster.slurm import ignore_usr1_if_told

    ignore_usr1_if_told()  # a child of `transom run` in a Slurm step: only the launcher acts on it
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    from transom.store import StoreError

    try:
        check_ids(args)
        return COMMANDS[args.command](args)
    except (ConfigError, StoreError) as e:
        print(f"transom: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `transom events | head` ends quietly. Not by restoring SIGPIPE's default action: that
        # would kill an agent or launcher that writes to a socket its peer closed.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
