"""The ranks agree on the step they restore: every rank loads the same one, or none.

Under a launcher the controller names a step to restore (TRANSOM_RESTORE_STEP: the newest the
catalog listed, which lags the saves by up to a second) and, after a rollback, the first not to
(TRANSOM_RESTORE_BEFORE); with a process group the ranks agree on the newest step they all hold
before that bound (engine.py lists a rank's candidates: the steps its node or a peer holds at or
after the plan's, the plan's, then older restorable ones), so a job that saves every step loses
at most the step in flight. Without a controller, each rank would take the newest step it can
read and fall back on its own when its copy is bad, so two ranks could resume from different
steps and train from mismatched state. `agree` makes the choice collective, by what the job has:

* **A torch.distributed process group of the engine's world** (the usual case: the script
  initialised it before loading): the ranks gather each other's newest MAX_CANDIDATES
  candidates (one all-gather) and try the steps every rank lists, newest first: each loads and
  verifies its shard, and an all-reduce of the outcomes decides: every rank good, every rank
  uses it; else every rank moves to the next step together.
* **No process group**: a rank takes a step only once every rank's shard of it in storage has
  verified (the manifest names them, the checksums are checked): the ranks read the same files
  and reach the same verdict without talking. That reads the whole step, world_size times a
  rank's own share: for large worlds a log line suggests initialising the process group first.

When no step is good for every rank, every rank raises one CheckpointError (there were bad
copies) or returns None (nothing saved): never some ranks one way and some the other.
This module never loads bytes that a tier has not verified, and never chooses a step that no
rank listed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from transom.checkpoint import shard_format, storage
from transom.checkpoint.client import LOAD_FAILED, PEER_COPIES_BAD, CheckpointError

log = logging.getLogger("transom.ckpt")

# A world this large or larger, loading without a process group, reads this many ranks' shards
# per rank: worth a hint.
LARGE_WORLD = 8
# The newest candidate steps of each rank that the ranks compare (a rank keeps a few in memory,
# the storage a few more).
MAX_CANDIDATES = 64

# Loads rank's shard of a step (verified) and returns its state; CheckpointError when no tier
# holds a good copy.
LoadStep = Callable[[int], Any]


def agree(
    candidates: list[int],
    load: LoadStep,
    world_size: int,
    storage_dir: Path,
) -> tuple[int, Any] | None:
    """(step, state) of the newest step every rank of `world_size` can load, the same on every
    rank; None when no rank has anything to load; CheckpointError on every rank when copies
    were bad and no step is good for all. `candidates` are this rank's restorable steps,
    newest first."""
    if world_size <= 1:
        return _alone(candidates, load)
    group = _process_group(world_size)
    if group:
        return _collectively(candidates, load)
    if world_size >= LARGE_WORLD:
        log.info(
            "loading without a process group: verifying all %d ranks' shards of a step in "
            "storage before using it (initialise torch.distributed before loading to agree "
            "by an all-reduce instead)",
            world_size,
        )
    return _by_storage(candidates, load, world_size, storage_dir)


def _alone(candidates: list[int], load: LoadStep) -> tuple[int, Any] | None:
    errors = []
    for step in candidates:
        try:
            return step, load(step)
        except CheckpointError as e:
            errors.append(str(e))
            log.warning("%s; trying an older step", e)
    if errors:
        raise CheckpointError(f"{LOAD_FAILED} of 1: {'; '.join(errors)}")
    return None


def spans(world_size: int) -> bool:
    """Whether the ranks of a world of `world_size` can agree by all-reduces (or need not)."""
    return world_size <= 1 or _process_group(world_size)


def _process_group(world_size: int) -> bool:
    """Whether the default process group spans this engine's world."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size


def _device() -> torch.device:
    """Where the default group's backend takes its tensors."""
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(value: int, op: str) -> int:
    """`value` reduced over the default group by MIN or MAX."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
    return int(t.item())


def _common(candidates: list[int]) -> list[int]:
    """The steps every rank lists among its MAX_CANDIDATES newest candidates, newest first: one
    all-gather of fixed-size tensors (no pickling)."""
    import torch.distributed as dist

    mine = sorted({s for s in candidates if s >= 0}, reverse=True)[:MAX_CANDIDATES]
    t = torch.full((MAX_CANDIDATES,), -1, dtype=torch.int64, device=_device())
    t[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    table = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(table, t)
    listed = [{int(s) for s in row.tolist() if s >= 0} for row in table]
    return sorted(set.intersection(*listed), reverse=True)


def _collectively(candidates: list[int], load: LoadStep) -> tuple[int, Any] | None:
    errors: list[str] = []
    for step in _common(candidates):  # newest first; the same list on every rank
        try:
            state, good = load(step), 1
        except CheckpointError as e:
            state, good = None, 0
            errors.append(str(e))
        if _reduce(good, "min"):
            return step, state
        log.warning("step %d is not good on every rank; every rank tries an older one", step)
    if _reduce(1 if errors else 0, "max"):
        raise CheckpointError(
            LOAD_FAILED + (f": {'; '.join(errors)}" if errors else f" ({PEER_COPIES_BAD})")
        )
    return None


def _by_storage(
    candidates: list[int], load: LoadStep, world_size: int, root: Path
) -> tuple[int, Any] | None:
    errors = []
    for step in candidates:
        bad = _unverified(root, step, world_size)
        if bad:
            errors.append(f"step {step}: {bad}")
            log.warning("step %d: %s; every rank tries an older step", step, bad)
            continue
        try:
            return step, load(step)
        except CheckpointError as e:  # every shard verified a moment ago: not expected
            errors.append(str(e))
            log.warning("%s; trying an older step", e)
    if errors:
        raise CheckpointError(f"{LOAD_FAILED} of {world_size}: {'; '.join(errors)}")
    return None


def _unverified(root: Path, step: int, world_size: int) -> str | None:
    """Why some rank's shard of `step` in storage is not good (None: all verify): every rank of
    the world that saved it (its manifest's; a resharded load reads them all)."""
    manifest = storage.read_manifest(root, step)
    saved_by = manifest.world_size if manifest is not None else None
    for rank in range(saved_by or world_size):
        try:
            storage.read_shard(storage.shard_path(root, step, rank), step, rank)
        except (shard_format.ShardError, OSError) as e:
            return f"rank {rank}'s shard in storage is not good ({e})"
    return None
