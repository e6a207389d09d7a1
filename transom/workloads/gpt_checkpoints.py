"""The example workload's checkpoints: the torch.save baseline and the Transom engine.

torch: rank 0 writes ckpt_dir/step_{s:08d}.pt (temp file, fsync, os.replace), then `latest`;
loading falls back to the newest older step that loads. transom: `engine_load` / `engine_save`
around transom.checkpoint.Engine. Used by transom/workloads/train_gpt.py. This module must never
decide when to checkpoint: the training loop does.
"""

import glob
import os
import re
import sys

import torch

from transom import checkpoint

RANK = int(os.environ.get("RANK", "0"))


def log(msg):
    """Print one line at once (one write: lines from several ranks on one pipe never mix)."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


CKPT_RE = re.compile(r"^step_(\d{8})\.pt$")


def ckpt_path(ckpt_dir, step):
    return os.path.join(ckpt_dir, f"step_{step:08d}.pt")


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path, write):
    """Call write(file) on a temp file next to `path`, fsync it, and rename it over `path`."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(directory)


def list_checkpoints(ckpt_dir):
    """Steps of the step_*.pt files in ckpt_dir, newest first."""
    steps = []
    for path in glob.glob(os.path.join(ckpt_dir, "step_*.pt")):
        m = CKPT_RE.match(os.path.basename(path))
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


def save_checkpoint(ckpt_dir, step, model, optimizer, seed, world_size, keep):
    """Rank 0 only: write the checkpoint for `step`, point `latest` at it, prune old ones."""
    os.makedirs(ckpt_dir, exist_ok=True)
    state = {
        "step": step,
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "seed": seed,
        "world_size": world_size,
    }
    atomic_write(ckpt_path(ckpt_dir, step), lambda f: torch.save(state, f))
    atomic_write(os.path.join(ckpt_dir, "latest"), lambda f: f.write(f"{step}\n".encode()))
    # Keep the newest `keep` up to this step. Files for later steps are left over from a run whose
    # `latest` could not be loaded; `latest` now points here, so they are dead too.
    steps = list_checkpoints(ckpt_dir)
    kept = [s for s in steps if s <= step][: max(keep, 1)]
    for old in steps:
        if old not in kept:
            try:
                os.remove(ckpt_path(ckpt_dir, old))
            except FileNotFoundError:
                pass


def try_load(ckpt_dir, step):
    """The checkpoint for `step`, or None (with a warning) when it is missing or unreadable."""
    path = ckpt_path(ckpt_dir, step)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if (
            not isinstance(state, dict)
            or state.get("step") != step
            or "model" not in state
            or "optim" not in state
        ):
            raise ValueError("not a train_gpt checkpoint for this step")
        return state
    except Exception as e:  # noqa: BLE001 - any failure means: try an older one
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        log(
            f"[train_gpt] warning: rank={RANK} cannot load checkpoint {path}: "
            f"{type(e).__name__}: {reason}"
        )
        return None


def load_latest_checkpoint(ckpt_dir):
    """The newest usable checkpoint: the one `latest` names, else the newest older one loading."""
    latest_file = os.path.join(ckpt_dir, "latest")
    candidates = list_checkpoints(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    try:
        with open(latest_file) as f:
            latest = int(f.read().strip())
    except FileNotFoundError:
        if not candidates:
            return None
        latest = None
        log(
            f"[train_gpt] warning: rank={RANK} {latest_file} is missing but checkpoints exist; "
            "using the newest that loads"
        )
    except ValueError:
        latest = None
        log(
            f"[train_gpt] warning: rank={RANK} {latest_file} is unreadable; "
            "using the newest checkpoint that loads"
        )
    if latest is not None:
        state = try_load(ckpt_dir, latest)
        if state is not None:
            return state
        candidates = [s for s in candidates if s < latest]
        log(
            f"[train_gpt] warning: rank={RANK} falling back from step {latest} "
            "to an older checkpoint"
        )
    for step in candidates:
        state = try_load(ckpt_dir, step)
        if state is not None:
            return state
    log(f"[train_gpt] warning: rank={RANK} no usable checkpoint in {ckpt_dir}; starting fresh")
    return None


def engine_load(engine):
    """The state transom.checkpoint restores for this rank, or None to start fresh."""
    try:
        state = engine.load()
    except checkpoint.CheckpointError as e:
        if engine.restore_step() is not None:
            # The controller chose this step for every rank: resuming from another would diverge.
            raise
        log(f"[train_gpt] warning: rank={RANK} no usable checkpoint ({e}); starting fresh")
        return None
    if state is not None:
        info = engine.last_load
        assert info is not None  # a load that returned a state set it
        how = f" resharded_from={info.resharded.from_world_size}" if info.resharded else ""
        log(
            f"[train_gpt] restored step={info.step} rank={RANK} tier={info.tier} "
            f"seconds={info.seconds:.3f}{how}"
        )
    return state


# The keys of engine_save's state that are the same on every rank: all of them.
REPLICATED = ("step", "model", "optim", "seed", "world_size")


def engine_save(engine, step, model, optimizer, seed, world_size, persist=True):
    """Every rank: copy its state into checkpoint memory and go on (the rest runs in background;
    not `persist`: no storage, every rank deciding alike). The copy overlaps the next step's
    forward and backward; its optimizer step waits for it (nothing else changes the state)."""
    state = {
        "step": step,
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "seed": seed,
        "world_size": world_size,
    }
    # Every value is the same on every rank (DDP), so a world of another size can resume from it;
    # the data position is a function of the step (gpt_model.get_batch), not saved per rank.
    handle = engine.save(step, state, replicated=REPLICATED, persist=persist, overlap=True)
    if not handle.ok:
        log(f"[train_gpt] warning: rank={RANK} checkpoint of step {step} refused: {handle.error}")
    return handle
