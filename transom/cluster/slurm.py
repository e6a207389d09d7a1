"""What a Slurm allocation tells a `transom run` task, checked, and the two `scontrol` calls.

`detect(environ)` reads the variables srun gives each task (SLURM_JOB_ID, SLURM_STEP_ID,
SLURM_NODEID, SLURMD_NODENAME, SLURM_JOB_NODELIST, SLURM_LOCALID, SLURM_RESTART_COUNT) and
returns the `Allocation`, or None outside a job step. The environment crossed a process
boundary: every id is checked (`check_id`), the node list is expanded by `scontrol show
hostnames` and must hold this node at position SLURM_NODEID; anything else is a `SlurmError`
with a one-line reason. `drain(node, reason)` asks slurmctld to stop giving `node` to jobs.

This module must never start a job's processes or talk to etcd.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from transom.common import env
from transom.common.names import BadId, check_id
from transom.job_spec import ConfigError

SCONTROL_TIMEOUT_S = 20.0
# Slurm's job ids are numbers; a step id is a number too under srun.
_NUMBER = re.compile(r"\d{1,12}")
# Prefix of the Transom job id of a Slurm job: slurm-<job>.<step>[-r<restart count>].
JOB_PREFIX = "slurm-"
DRAIN_REASON_PREFIX = "transom: "


class SlurmError(ConfigError):
    """The allocation's environment is not what srun gives, or scontrol failed; the message says
    what, in one line."""


@dataclass(frozen=True)
class Allocation:
    """This task's place in a Slurm job step."""

    job: str  # Slurm's job id
    step: str  # the step's id
    restart_count: int  # how often Slurm requeued the job (0 the first time)
    node: str  # this node's Slurm name
    nodes: tuple[str, ...]  # every node of the allocation, in Slurm's order

    @property
    def job_id(self) -> str:
        """The Transom job id: one per step and requeue, so a requeued job is a new Transom job
        (it resumes from storage, not from a finished job's state)."""
        restart = f"-r{self.restart_count}" if self.restart_count else ""
        return f"{JOB_PREFIX}{self.job}.{self.step}{restart}"

    @property
    def first(self) -> str:
        """The node that starts the job's etcd."""
        return self.nodes[0]

    @property
    def is_first(self) -> bool:
        return self.node == self.first


def _number(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name, "")
    if not _NUMBER.fullmatch(value):
        raise SlurmError(f"{name}={value!r}: not a Slurm id (a number)")
    return value


def detect(
    environ: Mapping[str, str], expand: Callable[[str], list[str]] | None = None
) -> Allocation | None:
    """This task's allocation, None outside a Slurm job step (no SLURM_JOB_ID or no
    SLURM_STEP_ID: e.g. the batch script itself, which must start `transom run` with srun).
    `expand` turns a node list into names (default `expand_nodelist`, i.e. scontrol)."""
    if "SLURM_JOB_ID" not in environ or "SLURM_STEP_ID" not in environ:
        return None
    job = _number(environ, "SLURM_JOB_ID")
    step = _number(environ, "SLURM_STEP_ID")
    node_index = int(_number(environ, "SLURM_NODEID"))
    restarts = (
        int(_number(environ, "SLURM_RESTART_COUNT")) if "SLURM_RESTART_COUNT" in environ else 0
    )
    if environ.get("SLURM_LOCALID", "0") != "0":
        raise SlurmError(
            "more than one `transom run` task on this node: run one per node "
            "(srun --ntasks-per-node=1); --nproc-per-node sets the workers per node"
        )
    try:
        node = check_id("SLURMD_NODENAME", environ.get("SLURMD_NODENAME", ""))
    except BadId as e:
        raise SlurmError(str(e)) from None
    nodes = (expand or expand_nodelist)(
        environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    )
    try:
        nodes = [check_id("node name", n) for n in nodes]
    except BadId as e:
        raise SlurmError(f"SLURM_JOB_NODELIST: {e}") from None
    if not nodes:
        raise SlurmError("SLURM_JOB_NODELIST: no nodes")
    if node_index >= len(nodes) or nodes[node_index] != node:
        raise SlurmError(
            f"SLURM_NODEID={node_index} does not name this node {node} in the node list {nodes}"
        )
    return Allocation(job, step, restarts, node, tuple(nodes))


def _scontrol(*argv: str) -> str:
    if shutil.which("scontrol") is None:
        raise SlurmError("scontrol is not on PATH")
    try:
        done = subprocess.run(
            ["scontrol", *argv],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"scontrol {' '.join(argv)}: {e}") from None
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        raise SlurmError(f"scontrol {' '.join(argv)}: {why[-1] if why else done.returncode}")
    return done.stdout


def expand_nodelist(nodelist: str) -> list[str]:
    """`n[1-3],gpu7` -> ['n1', 'n2', 'n3', 'gpu7'] (by `scontrol show hostnames`; `detect`
    checks every name)."""
    if not nodelist or any(c.isspace() for c in nodelist):
        raise SlurmError(f"SLURM_JOB_NODELIST={nodelist!r}: not a Slurm node list")
    return _scontrol("show", "hostnames", nodelist).split()


def drain(node: str, reason: str) -> None:
    """Drain `node`: its running jobs go on, slurmctld gives it to no new job until an admin
    resumes it. SlurmError when scontrol refuses (e.g. the user is not a Slurm operator)."""
    check_id("node", node)
    text = DRAIN_REASON_PREFIX + " ".join(reason.split())
    _scontrol("update", f"nodename={node}", "state=drain", f"reason={text[:200]}")


def ignore_usr1_if_told() -> None:
    """In a process `transom run` started in a Slurm step: ignore SIGUSR1 (children inherit
    that through exec), so the time limit's warning does not kill agents or workers."""
    if os.environ.get(env.IGNORE_USR1) == "1":
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
