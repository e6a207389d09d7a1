"""etcd key names of one job, relative to the job's prefix `/transom/<job-id>/` (see `Store`).

All values are JSON. Every reader and writer builds keys with these names and functions, never
with string literals of its own.
  spec              the job spec the first launcher wrote (`JobSpec`)
  nodes/<node>      a node agent's registration, attached to its lease (node death = expiry)
  status/<node>     what the agent's workers are doing for which generation
  leader            the controller leader's id, attached to its lease
  job               the controller's state: state, generation, members, evictions, restarts
  plan              what every agent must run: generation, members, restore step
  plan/master/<gen> the master address and port chosen by the master node's agent (under the
                    plan's name: agents following the plan get it on the same watch)
  plan/summaries    the controller's request for a fresh monitor summary from every member
                    (`SummaryRequest`; under the plan's name for the same reason)
  events/<seq>      the decision log, one event per key, in time order
  monitor/<node>    the agent's monitor summary: per-rank step, ages, timings; its anomalies
  preflight/<node>  the node's pre-flight result (checks, compute benchmark score, link scores)
  links/<node>      the address of the node's link-test server, under its lease
  faults/fired/<id> injected faults that already fired (each fires once per job)
  exporter          the leading controller's Prometheus endpoint
  ckpt/secret       the checkpoint peers' shared secret
  ckpt/servers/<node>            a checkpoint server's peer address, under its lease
  ckpt/flushed/<node>            the generation whose recovery the server sent its holdings for
  ckpt/shards/<step>/<rank>/<holder>  where a shard is held (memory of a node, or storage)
  slurm/drained/<node>           a Slurm node --slurm-drain drained (transom.cluster)

This module must never do I/O: it only names things.
"""

from __future__ import annotations

SPEC = "spec"
JOB = "job"
PLAN = "plan"
LEADER = "leader"
EXPORTER = "exporter"
NODES = "nodes/"
STATUS = "status/"
MONITOR = "monitor/"
PREFLIGHT = "preflight/"
LINKS = "links/"
MASTER = PLAN + "/master/"
SUMMARY_REQUEST = PLAN + "/summaries"
EVENTS = "events/"
FAULTS_FIRED = "faults/fired/"
CKPT_SECRET = "ckpt/secret"
CKPT_SERVERS = "ckpt/servers/"
CKPT_SHARDS = "ckpt/shards/"
# A checkpoint server's word that it sent what it holds, at a recovery (catalog.Flushed).
CKPT_FLUSHED = "ckpt/flushed/"
SLURM_DRAINED = "slurm/drained/"
# Steps discarded as poisoned (a list of {first_bad_step, generation}): servers drop them.
CKPT_DISCARDED = "ckpt/discarded"


def node(node_id: str) -> str:
    return NODES + node_id


def status(node_id: str) -> str:
    return STATUS + node_id


def monitor(node_id: str) -> str:
    return MONITOR + node_id


def preflight(node_id: str) -> str:
    return PREFLIGHT + node_id


def link(node_id: str) -> str:
    return LINKS + node_id


def master(generation: int) -> str:
    return f"{MASTER}{generation}"


def fault_fired(fault_id: str) -> str:
    return FAULTS_FIRED + fault_id


def event(time_s: float, source: str) -> str:
    """An event's key: nanoseconds first, so a prefix read lists events in time order.

    `source` names the writer (and makes keys of one instant unique): a controller id, a node
    id with a suffix, `launcher`.
    """
    return f"{EVENTS}{int(time_s * 1e9):020d}-{source}"


def events_before(time_s: float) -> str:
    """Where the events written before `time_s` end: every key of an earlier time sorts below
    it, every key of that time or later above (`event`)."""
    return f"{EVENTS}{int(time_s * 1e9):020d}"


def ckpt_server(node_id: str) -> str:
    return CKPT_SERVERS + node_id


def ckpt_flushed(node_id: str) -> str:
    return CKPT_FLUSHED + node_id


def ckpt_shard(step: int, rank: int, holder: str) -> str:
    return f"{CKPT_SHARDS}{step:012d}/{rank:06d}/{holder}"


def slurm_drained(node_id: str) -> str:
    """Claimed by the launcher that drains evicted `node_id` in Slurm (so one does, once)."""
    return SLURM_DRAINED + node_id
