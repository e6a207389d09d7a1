"""A small character-level GPT, trained with DDP on CPU: the workload of Transom's demo and tests.

It exists to be a realistic-but-cheap training job for a fault-tolerant launcher: several ranks
that talk to each other every step (DDP, gloo backend), checkpoints on disk, resumption after a
crash, and progress lines a benchmark can parse. The model is nanoGPT in miniature (token and
position embeddings, pre-LayerNorm transformer blocks, tied output head), trained on a synthetic
corpus the script writes itself, so it needs no downloads and no data files.

Run it like any torchrun script:

    python examples/train_gpt.py --steps 20                       # one process, no process group
    torchrun --nproc-per-node 3 examples/train_gpt.py --steps 50  # three ranks, DDP over gloo

(examples/train_gpt.py runs this file, transom/workloads/train_gpt.py, which ships inside the
package; its data and model are in gpt_model.py, its checkpoints in gpt_checkpoints.py.)

Determinism: for a given --seed and world size the final weights are bit-identical, whether the run
went through uninterrupted or was killed and resumed from a checkpoint. That holds because
  * the model is initialised right after torch.manual_seed(seed), and there is no dropout;
  * each step's batch comes from a torch.Generator seeded from (seed, step, rank), so where a rank
    reads in the corpus is a pure function of the step, not of how many steps this process has run;
  * the learning rate is a function of the step alone (a warmup, then constant; it does not
    depend on --steps, so a run with --steps 50 and one with --steps 100 agree on the first 50);
  * the checkpoint holds the model and the optimizer state (AdamW moments and step counts);
  * DDP keeps one fixed gradient bucket layout for the whole run (see make_ddp), so gradients are
    summed in the same order on every step.
A run that resumes with another world size (an elastic shrink or grow under `transom run
--nnodes MIN:MAX`, or torchrun with another --nproc-per-node) resumes from the newest checkpoint
too: every value saved is the same on every rank and declared so (gpt_checkpoints.REPLICATED),
so any rank's copy serves any new rank (transom/checkpoint/reshard.py), and a rank's batches are
a function of (seed, step, rank), so the data order is deterministic for the new world; it is
not bit-identical to a run that kept its world size (it prints a warning saying so).

Checkpoints: the checkpoint for step s holds the state after step s was applied; a run that finds
it resumes at step s+1 (steps are numbered 1..--steps). Two implementations (--checkpoint):
  transom (default)  every rank saves its state with transom.checkpoint every --ckpt-every
      steps (default: every step): the save blocks only for a copy into its node's checkpoint
      memory, which replicates it to a peer node and persists it to --ckpt-dir in the
      background (with --persist-every P, only steps that are multiples of P and the run's
      last; by default every 20th when saving every step). At start every rank loads the newest
      step all ranks hold at or after the one the controller chose (TRANSOM_RESTORE_STEP under
      `transom run`: a fault costs at most the step in flight), else the newest step restorable
      for every rank, from the fastest tier with a good copy. Outside `transom run` the engine
      runs inside the process (memory + --ckpt-dir).
  torch  rank 0 writes ckpt_dir/step_{s:08d}.pt with torch.save (temp file, fsync, os.replace),
      then the text file ckpt_dir/latest holding s, and all ranks wait for it; older checkpoints
      beyond --keep are removed. At start every rank reads `latest` and loads the checkpoint it
      names, falling back to the newest older step_*.pt that loads when that one is missing or
      corrupt. (The baseline benchmarks compare with.)

Failure behaviour of a plain torchrun job (what the goodput benchmark's baseline uses):
  --collective-timeout S  a collective that waits longer than S seconds for a peer fails (gloo's
                          default is 30 min, NCCL's 10 min), so a hung peer ends the job's attempt;
  --fail-on-nan           a rank whose loss is not finite raises before backward, as Megatron-style
                          checks do, so torchrun restarts the job from the last checkpoint.
Under `transom run` a rank whose loss is not finite reports it and then waits (--nan-hold, 30 s)
for the controller's rollback instead of training on poisoned weights.

Output lines (parsed by benchmarks; t is time.time()):
    [train_gpt] start rank=R world=W t=...       every rank, at process start
    [train_gpt] resumed step=S rank=R t=...      every rank, S = last completed step, 0 when fresh
    step 12 loss 3.1234 t=...                    rank 0, every --log-every steps and the first
    [train_gpt] done step=N rank=R t=...         every rank, at the end
With --result-dir DIR every rank also keeps DIR/rankR.json (results.py): its resumed step, last
step, loss and whether it finished, for programs that should not parse these lines.
"""

import os
import sys
import time

RANK = int(os.environ.get("RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
# Checkpoint every this many steps by default: a memory copy every step with transom (a fault
# costs at most the step in flight), a file every 20 with torch.save (each blocks training).
CKPT_EVERY = {"transom": 1, "torch": 20}
# Saving every step, storage takes every this many (and the run's last): memory and a peer's
# memory hold the others.
PERSIST_EVERY_STEP = 20
# Under `transom run`, a rank whose loss is not finite waits this long for the rollback.
NAN_HOLD_S = 30.0

# Say we are alive before the slow imports, so a launcher can see how long a (re)start takes.
if __name__ == "__main__" and not {"-h", "--help"} & set(sys.argv[1:]):
    sys.stdout.write(f"[train_gpt] start rank={RANK} world={WORLD_SIZE} t={time.time():.3f}\n")
    sys.stdout.flush()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import threading  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Run by path: import the transom this file belongs to (a checkout's, or the installed one).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transom import checkpoint, monitor  # noqa: E402
from transom.common import env  # noqa: E402
from transom.workloads.gpt_checkpoints import (  # noqa: E402
    atomic_write,
    engine_load,
    engine_save,
    load_latest_checkpoint,
    log,
    save_checkpoint,
)
from transom.workloads.gpt_model import (  # noqa: E402
    GPT,
    average_gradients,
    encode,
    evaluate,
    get_batch,
    lr_at,
    make_corpus,
    make_ddp,
    make_optimizer,
)
from transom.workloads.results import write_result  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train a small character-level GPT on a synthetic corpus with DDP (gloo, CPU). "
        "Run directly for one process, or under torchrun for several ranks. "
        "Resumes from the newest checkpoint in --ckpt-dir.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--steps", type=int, default=200, help="train until this step (steps are numbered from 1)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed for model init and batch sampling")
    p.add_argument(
        "--checkpoint",
        choices=("transom", "torch"),
        default="transom",
        help="transom: in-memory checkpoints of every rank, replicated and persisted in the "
        "background; torch: rank 0 writes torch.save files and every rank waits for it",
    )
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=None,
        metavar="K",
        help=f"checkpoint every K steps; 0 disables (default: {CKPT_EVERY['transom']} with "
        f"--checkpoint transom, {CKPT_EVERY['torch']} with torch)",
    )
    p.add_argument(
        "--persist-every",
        type=int,
        default=None,
        metavar="P",
        help="transom: write to --ckpt-dir only the checkpoints of steps that are multiples of P "
        "and the run's last one; the others stay in memory and a peer's memory (and a stopping "
        f"checkpoint server writes its newest); 0: every checkpoint (the default: "
        f"{PERSIST_EVERY_STEP} when checkpointing every step, else 0)",
    )
    p.add_argument(
        "--ckpt-dir",
        default=os.environ.get(env.CHECKPOINT_DIR) or "./checkpoints",
        help="checkpoint directory (storage tier); the default is $TRANSOM_CHECKPOINT_DIR if set, "
        "else ./checkpoints",
    )
    p.add_argument("--keep", type=int, default=2, help="number of checkpoints to keep on disk")
    p.add_argument("--batch-size", type=int, default=12, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=64, help="context length in characters")
    p.add_argument("--n-layer", type=int, default=2, help="transformer blocks")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--n-embd", type=int, default=64, help="embedding width")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (after warmup)")
    p.add_argument("--warmup", type=int, default=10, help="linear learning-rate warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices")
    p.add_argument(
        "--grad-clip", type=float, default=1.0, help="clip the gradient norm to this; 0 disables"
    )
    p.add_argument(
        "--log-every",
        type=int,
        default=10,
        help="rank 0 prints the loss every N steps; 0: only the first",
    )
    p.add_argument(
        "--save-final",
        metavar="PATH",
        help="rank 0 saves the final model state_dict here (torch.save)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="K",
        help="evaluate on held-out batches every K steps; 0 disables",
    )
    p.add_argument("--eval-batches", type=int, default=4, help="batches per evaluation")
    p.add_argument(
        "--collective-timeout",
        type=float,
        metavar="SECONDS",
        help="timeout of every collective (init_process_group's timeout); default: torch's "
        "(30 min for gloo)",
    )
    p.add_argument(
        "--fail-on-nan",
        action="store_true",
        help="raise (and exit) when this rank's loss is not finite, instead of going on",
    )
    p.add_argument(
        "--nan-hold",
        type=float,
        default=None,
        metavar="S",
        help="after a step whose loss is not finite, wait up to S seconds (for the controller's "
        f"rollback, which stops the workers) before going on (default: {NAN_HOLD_S:.0f} under "
        "`transom run`, else 0)",
    )
    p.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="sleep this long after each step (makes a job last longer in tests)",
    )
    p.add_argument(
        "--result-dir",
        metavar="DIR",
        help="every rank keeps DIR/rankR.json: resumed step, last step, loss, done "
        "(transom/workloads/results.py)",
    )
    args = p.parse_args(argv)
    if args.nan_hold is None:
        args.nan_hold = NAN_HOLD_S if os.environ.get(env.GENERATION) else 0.0
    if args.ckpt_every is None:
        args.ckpt_every = CKPT_EVERY[args.checkpoint]
    if args.persist_every is None:
        every_step = args.checkpoint == "transom" and args.ckpt_every == 1
        args.persist_every = PERSIST_EVERY_STEP if every_step else 0
    if args.persist_every < 0:
        p.error(f"--persist-every {args.persist_every}: steps, 0 or more")
    if args.persist_every and args.checkpoint != "transom":
        p.error("--persist-every needs --checkpoint transom (torch writes every checkpoint)")
    return args


def main(argv=None):
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ
    rank, world_size = (RANK, WORLD_SIZE) if distributed else (0, 1)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        torch.use_deterministic_algorithms(True)
    except Exception as e:  # noqa: BLE001
        log(f"[train_gpt] warning: deterministic algorithms unavailable: {e}")
    if distributed:
        timeout = (
            None
            if args.collective_timeout is None
            else datetime.timedelta(seconds=args.collective_timeout)
        )
        dist.init_process_group(
            "gloo", timeout=timeout
        )  # env:// - MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE

    # Data
    text = make_corpus()
    chars = sorted(set(text))
    data = encode(text, chars)

    # Model and optimizer, then the checkpoint (if any) on top
    torch.manual_seed(args.seed)
    model = GPT(len(chars), args.block_size, args.n_layer, args.n_head, args.n_embd)
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    start_step = saved_world = 0
    engine = None
    if args.checkpoint == "transom":
        engine = checkpoint.Engine(
            storage_dir=args.ckpt_dir, keep=args.keep, rank=rank, world_size=world_size
        )
        state = engine_load(engine)
    else:
        state = load_latest_checkpoint(args.ckpt_dir)
    if state is not None:
        if state.get("seed") != args.seed or state.get("world_size") != world_size:
            log(
                f"[train_gpt] warning: rank={rank} checkpoint was written with "
                f"seed={state.get('seed')} world_size={state.get('world_size')}, "
                f"now seed={args.seed} world_size={world_size}; "
                f"resuming anyway, but not bit-identical to an uninterrupted run"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start_step, saved_world = state["step"], int(state.get("world_size") or 0)
        del state
    if distributed:  # all ranks must resume from the same checkpoint, or they would diverge
        lo, hi = torch.tensor([start_step, saved_world]), torch.tensor([start_step, saved_world])
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if not torch.equal(lo, hi):
            raise RuntimeError(
                f"ranks found different checkpoints (steps {lo[0].item()}..{hi[0].item()}, "
                f"saved by worlds of {lo[1].item()}..{hi[1].item()}); "
                f"is {args.ckpt_dir} shared by all ranks?"
            )
    log(f"[train_gpt] resumed step={start_step} rank={rank} t={time.time():.3f}")

    def result(step, loss=None, done=False):
        if args.result_dir:
            write_result(
                args.result_dir,
                rank,
                world_size=world_size,
                resumed_step=start_step,
                step=step,
                loss=loss,
                done=done,
            )

    result(start_step)

    ddp_model = make_ddp(model) if distributed else model
    last_save = None

    # Training loop. With DDP the gradient all-reduce would overlap backward, so the monitor could
    # not tell compute from communication: backward runs under no_sync() and the gradients are
    # averaged in the monitor's "sync" section, one flat all-reduce in a fixed order (deterministic
    # on resume).
    params = [p for p in model.parameters() if p.requires_grad]
    tokens_per_step = args.batch_size * args.block_size
    for step in range(start_step + 1, args.steps + 1):
        with monitor.step(step) as s:
            lr = lr_at(step, args.lr, args.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = get_batch(data, step, rank, args.seed, args.batch_size, args.block_size)
            with ddp_model.no_sync() if distributed else contextlib.nullcontext():
                _, loss = ddp_model(x, y)
                loss = s.inject(loss)  # fault injection hook: NaN when a test schedules it
                if args.fail_on_nan and not math.isfinite(loss.item()):
                    raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            with s.section("sync"):
                if distributed:
                    average_gradients(params, world_size)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                params, args.grad_clip if args.grad_clip > 0 else math.inf
            )
            optimizer.step()
            loss_value = loss.item()  # this rank's loss; the gradients were averaged over all ranks

            if rank == 0 and (
                step == start_step + 1 or (args.log_every > 0 and step % args.log_every == 0)
            ):
                log(f"step {step} loss {loss_value:.4f} t={time.time():.3f}")
            if args.log_every > 0 and step % args.log_every == 0:
                result(step, loss_value)
            # Never checkpoint poisoned weights (the gradient norm is the same on every rank).
            if (
                args.ckpt_every > 0
                and step % args.ckpt_every == 0
                and math.isfinite(grad_norm.item())
            ):
                if engine is not None:
                    # A memory copy, part of the step like the optimizer's (not a phase, which
                    # would leave the step out of the monitor's timings: every step, saving
                    # every step).
                    persist = (
                        args.persist_every <= 0
                        or step % args.persist_every == 0
                        or step + args.ckpt_every > args.steps  # the run's last checkpoint
                    )
                    last_save = engine_save(
                        engine, step, model, optimizer, args.seed, world_size, persist
                    )
                else:
                    with monitor.phase("checkpoint"):  # a file write: it may take long
                        if rank == 0:
                            save_checkpoint(
                                args.ckpt_dir,
                                step,
                                model,
                                optimizer,
                                args.seed,
                                world_size,
                                args.keep,
                            )
                        if distributed:
                            # Nobody runs ahead of a checkpoint that is not yet on disk.
                            dist.barrier()
            if args.eval_every > 0 and step % args.eval_every == 0:
                with monitor.phase("eval"):
                    val = evaluate(model, data, step, rank, args)
                if rank == 0:
                    log(f"eval step {step} loss {val:.4f} t={time.time():.3f}")
            s.report(loss=loss_value, tokens=tokens_per_step)
        if args.nan_hold > 0 and not math.isfinite(loss_value):
            log(
                f"[train_gpt] rank={rank} loss is {loss_value} at step {step}: waiting up to "
                f"{args.nan_hold:.0f} s for a rollback t={time.time():.3f}"
            )
            threading.Event().wait(args.nan_hold)
        if args.step_delay > 0:
            time.sleep(args.step_delay)

    final_step = max(start_step, args.steps)
    if rank == 0 and args.save_final:
        out_dir = os.path.dirname(os.path.abspath(args.save_final))
        os.makedirs(out_dir, exist_ok=True)
        final_state = model.state_dict()
        atomic_write(os.path.abspath(args.save_final), lambda f: torch.save(final_state, f))
    if engine is not None:
        if last_save is not None and last_save.ok:
            try:
                last_save.wait("storage")  # the job's last checkpoint is on disk before it ends
            except checkpoint.CheckpointError as e:
                log(f"[train_gpt] warning: rank={rank} final checkpoint not persisted: {e}")
        engine.close()
    log(f"[train_gpt] done step={final_step} rank={rank} t={time.time():.3f}")
    result(final_step, done=True)
    if distributed:
        # Free DDP before the process group. DDP's C++ reducer holds a reference to the group; if
        # it were the last one, the gloo group would be destroyed (joining its worker threads) while
        # this thread holds the GIL, and a worker thread that needs the GIL to drop its last work
        # item deadlocks the exit. Seen about once in 10-20 runs on a loaded machine.
        del ddp_model
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
