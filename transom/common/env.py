"""Environment variable names: what the agent gives its workers, and Transom's own knobs.

A worker gets what torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE, ...) plus these. Writers
(control/workers.py, the agent) and readers (transom.monitor, transom.checkpoint, the warm
interpreters) use these names, never literals. This module must never read the environment.
"""

from __future__ import annotations

# -- what every worker gets -----------------------------------------------------------------------
JOB_ID = "TRANSOM_JOB_ID"
NODE_ID = "TRANSOM_NODE_ID"
GENERATION = "TRANSOM_GENERATION"
STORE = "TRANSOM_STORE"
RUN_DIR = "TRANSOM_RUN_DIR"
# The step this generation resumes from; absent means start fresh.
RESTORE_STEP = "TRANSOM_RESTORE_STEP"
# After a rollback: the first step not to restore (the poisoned one); absent: no bound. With a
# process group the ranks restore the newest step they all hold in [RESTORE_STEP, RESTORE_BEFORE).
RESTORE_BEFORE = "TRANSOM_RESTORE_BEFORE"
# The storage tier of checkpoints (a directory shared by all nodes).
CHECKPOINT_DIR = "TRANSOM_CHECKPOINT_DIR"
# The node's checkpoint server: its Unix socket and the secret that authenticates requests.
CKPT_SOCKET = "TRANSOM_CKPT_SOCKET"
CKPT_SECRET = "TRANSOM_CKPT_SECRET"
# Where transom.monitor sends its samples: the path of the agent's monitor channel (a Unix
# datagram socket in a private directory, see transom.monitor.channel).
MONITOR_SOCKET = "TRANSOM_MONITOR_SOCKET"
# Faults the worker applies itself (JSON list), for tests, benchmarks and the demo.
FAULTS = "TRANSOM_FAULTS"
# "0": the worker bootstrap installs no automatic instrumentation (`--no-auto-monitor`);
# anything else or unset: it does (transom.monitor.auto).
AUTO_MONITOR = "TRANSOM_AUTO_MONITOR"
# Replica fingerprints every N steps (transom.monitor.fingerprint; 0: off).
FINGERPRINT_EVERY = "TRANSOM_FINGERPRINT_EVERY"
# The directory of the files (common.files.stacks_name) the worker's faulthandler writes its main
# thread's stack to when the agent sends it transom.monitor.stacks.STACKS_SIGNAL (unset: no
# handler is registered and the agent never sends it).
STACKS_DIR = "TRANSOM_STACKS_DIR"
# The node's folder where a rank keeps its parameters at its fingerprint steps, for a replay to
# compare with (transom.monitor.evidence; unset: none kept).
EVIDENCE_DIR = "TRANSOM_EVIDENCE_DIR"

# -- Slurm (transom.cluster) -------------------------------------------------------------------
# Set for the processes `transom run` starts in a Slurm step: they ignore SIGUSR1, the time
# limit's warning that Slurm sends to every process of the step, which only the launcher acts on.
IGNORE_USR1 = "TRANSOM_IGNORE_USR1"

# -- the warm interpreter (control/warm.py) ------------------------------------------------------
WARM_IMPORTS = "TRANSOM_WARM_IMPORTS"
WARM_IDLE_IMPORTS = "TRANSOM_WARM_IDLE_IMPORTS"
# Set by a launcher that runs several nodes on its machine, for their agents: the socket of its
# warm template (control/warm_template.py), which forks each node's warm interpreter.
WARM_TEMPLATE = "TRANSOM_WARM_TEMPLATE"
