"""Run-directory layout: the names of every file Transom writes under `--run-dir`.

RUN_DIR/
  logs/gNNN/rankR.log     each rank's output, per generation
  logs/gNNN/rankR.stacks  each rank's Python stacks, dumped when its node looked hung
  evidence/NODE/          each rank's parameters at its newest fingerprint steps
                          (transom.monitor.evidence)
  logs/agent-NODE.log     a node agent's log (warm-NODE.log: its warm interpreter's)
  logs/controller-HOST-I.log  a controller candidate's log (the candidate id is its name)
  logs/etcd.log, logs/reference.log   the embedded etcd; the demo's fault-free run
  etcd/                   the embedded etcd's data
  etcd-tls/               its certificates for this run (mode 0700, files 0600): ca.crt,
                          server.crt/.key (etcd's), client.crt/.key (every Transom process's)
  events.jsonl            the decision log (one JSON event a line)
  status.json             the job's last snapshot
  progress.jsonl          the job's step, generation and membership whenever one changes
                          (these three only where the launcher mirrors the job: under Slurm the
                          first node's folder, with `--no-mirror` not that machine's; NOT_MIRRORED)
  checkpoints/            the storage tier (TRANSOM_CHECKPOINT_DIR) unless --ckpt-storage
  report.png|md|json      `transom report`
  final_weights.pt, reference_weights.pt, reference.json: the demo's weights and reference
  previous/TIME/          what an earlier run on one machine left in this folder (its etcd,
                          events, status, progress, logs and report), moved when a rerun starts
  .launcher.lock          held by the `transom run` that uses this folder on one machine

This module must never do I/O: it only names things.
"""

from __future__ import annotations

from pathlib import Path

LOGS = "logs"
EVIDENCE = "evidence"
EVENTS = "events.jsonl"
STATUS = "status.json"
PROGRESS = "progress.jsonl"
CHECKPOINTS = "checkpoints"
ETCD = "etcd"
ETCD_TLS = "etcd-tls"
# Where a Slurm job's first node tells the others how to reach the etcd it started.
STORE_RENDEZVOUS = "store.json"
REPORT_PNG = "report.png"
REPORT_MD = "report.md"
REPORT_JSON = "report.json"
FINAL_WEIGHTS = "final_weights.pt"
REFERENCE_WEIGHTS = "reference_weights.pt"
REFERENCE = "reference.json"
PREVIOUS_RUNS = "previous"
LAUNCHER_LOCK = ".launcher.lock"
# What a run on one machine leaves in its folder that a rerun there must not mix with its own.
RUN_STATE = (
    ETCD,
    ETCD_TLS,
    EVENTS,
    STATUS,
    PROGRESS,
    LOGS,
    EVIDENCE,
    REPORT_PNG,
    REPORT_MD,
    REPORT_JSON,
)


def generation_logs(run_dir: Path, generation: int) -> Path:
    return run_dir / LOGS / f"g{generation:03d}"


# The master node's torch store host's output, in its generation's logs (control.store_host).
TORCH_STORE_LOG = "torch-store.log"


def rank_log(run_dir: Path, generation: int, rank: int) -> Path:
    return generation_logs(run_dir, generation) / f"rank{rank}.log"


def evidence_dir(run_dir: Path, node_id: str) -> Path:
    return run_dir / EVIDENCE / node_id


def stacks_name(rank: int) -> str:
    """A rank's stacks file in its generation's log directory."""
    return f"rank{rank}.stacks"


def agent_log(run_dir: Path, node_id: str) -> Path:
    return log_file(run_dir, f"agent-{node_id}")


def warm_log(run_dir: Path, node_id: str) -> Path:
    return log_file(run_dir, f"warm-{node_id}")


def log_file(run_dir: Path, name: str) -> Path:
    """RUN_DIR/logs/NAME.log: a process's own log (controllers are named `controller-...`)."""
    return run_dir / LOGS / f"{name}.log"


# What to tell someone reading a launcher's folder that holds none of the mirrored files.
NOT_MIRRORED = (
    "a launcher that did not mirror the job (under Slurm only the first node's folder has "
    "status.json, events.jsonl and progress.jsonl; with --no-mirror another machine's has them)"
)
