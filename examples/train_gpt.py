"""A small character-level GPT, trained with DDP on CPU: the workload Transom's examples and tests run.

It exists to be a realistic-but-cheap training job for a fault-tolerant launcher: several ranks
that talk to each other every step (DDP, gloo backend), checkpoints on disk, resumption after a
crash, and progress lines a benchmark can parse. The model is nanoGPT in miniature (token and
position embeddings, pre-LayerNorm transformer blocks, tied output head), trained on a synthetic
corpus the script writes itself, so it needs no downloads and no data files.

Run it like any torchrun script:

    python examples/train_gpt.py --steps 20                         # one process, no process group
    torchrun --nproc-per-node 3 examples/train_gpt.py --steps 50    # three ranks, DDP over gloo

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

Checkpoints: the checkpoint for step s holds the state after step s was applied; a run that finds
it resumes at step s+1 (steps are numbered 1..--steps). Two implementations (--checkpoint):
  transom (default)  every rank saves its state with transom.checkpoint every --ckpt-every steps: the
                     save blocks only for a copy into its node's checkpoint memory, which replicates it
                     to a peer node and persists it to --ckpt-dir in the background. At start every rank
                     loads the step the controller chose (TRANSOM_RESTORE_STEP under `transom run`), else
                     the newest step restorable for every rank, from the fastest tier with a good copy.
                     Outside `transom run` the engine runs inside the process (memory + --ckpt-dir).
  torch              rank 0 writes ckpt_dir/step_{s:08d}.pt with torch.save (temp file, fsync,
                     os.replace), then the text file ckpt_dir/latest holding s, and all ranks wait for
                     it; older checkpoints beyond --keep are removed. At start every rank reads `latest`
                     and loads the checkpoint it names, falling back to the newest older step_*.pt that
                     loads when that one is missing or corrupt. (The baseline benchmarks compare with.)

Failure behaviour of a plain torchrun job (what the goodput benchmark's baseline uses):
  --collective-timeout S  a collective that waits longer than S seconds for a peer fails (gloo's
                          default is 30 min, NCCL's 10 min), so a hung peer ends the job's attempt;
  --fail-on-nan           a rank whose loss is not finite raises before backward, as Megatron-style
                          checks do, so torchrun restarts the job from the last checkpoint.

Output lines (parsed by benchmarks; t is time.time()):
    [train_gpt] start rank=R world=W t=...       every rank, at process start
    [train_gpt] resumed step=S rank=R t=...      every rank, S = last completed step, 0 when fresh
    step 12 loss 3.1234 t=...                    rank 0, every --log-every steps and the first step run
    [train_gpt] done step=N rank=R t=...         every rank, at the end
"""

import os
import sys
import time

RANK = int(os.environ.get("RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))

# Say we are alive before the slow imports, so a launcher can see how long a (re)start takes.
if __name__ == "__main__" and not {"-h", "--help"} & set(sys.argv[1:]):
    sys.stdout.write(f"[train_gpt] start rank={RANK} world={WORLD_SIZE} t={time.time():.3f}\n")
    sys.stdout.flush()

import argparse
import contextlib
import datetime
import glob
import hashlib
import math
import random
import re

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    from transom import checkpoint, monitor
except ImportError:  # running from a checkout that is not installed: use the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from transom import checkpoint, monitor


def log(msg):
    """Print one line at once (a single write, so lines from several ranks on one pipe never mix)."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


# -----------------------------------------------------------------------------
# Data: a synthetic corpus of simple English-like sentences, made from a fixed word list and a
# fixed-seed random generator, so it is the same on every machine and every run. The sentences have
# structure (determiner, adjectives, noun, verb agreeing in number, object, optional phrase) so a
# character-level model has plenty to learn and the loss goes down quickly.

CORPUS_SEED = 1234
CORPUS_CHARS = 300_000

NOUNS = [
    "cat",
    "dog",
    "bird",
    "horse",
    "farmer",
    "child",
    "teacher",
    "robot",
    "river",
    "tree",
    "garden",
    "city",
    "ship",
    "engine",
    "lamp",
    "window",
    "king",
    "baker",
    "wolf",
    "cloud",
]
PLURAL = {"child": "children", "wolf": "wolves", "city": "cities"}
ADJECTIVES = [
    "small",
    "old",
    "red",
    "quiet",
    "bright",
    "happy",
    "heavy",
    "green",
    "strange",
    "clever",
    "cold",
    "tall",
    "gentle",
    "broken",
    "golden",
]
VERBS = [
    "see",
    "like",
    "follow",
    "watch",
    "carry",
    "find",
    "help",
    "paint",
    "chase",
    "hear",
    "build",
    "keep",
    "move",
    "open",
    "visit",
]
PREPOSITIONS = ["near", "under", "behind", "beside", "across", "over", "inside"]
ADVERBS = ["slowly", "often", "quietly", "again", "today", "never", "always"]


def noun_phrase(rng, plural):
    noun = rng.choice(NOUNS)
    if plural:
        noun = PLURAL.get(noun, noun + "s")
    adjectives = [rng.choice(ADJECTIVES) for _ in range(rng.choice([0, 0, 1, 1, 2]))]
    det = (
        rng.choice(["the", "some", "two", "many"])
        if plural
        else rng.choice(["the", "a", "one", "every"])
    )
    return " ".join([det] + adjectives + [noun])


def sentence(rng):
    plural = rng.random() < 0.4
    verb = rng.choice(VERBS)
    if not plural:  # third person singular: see -> sees, watch -> watches, carry -> carries
        if verb.endswith("y"):
            verb = verb[:-1] + "ies"
        elif verb.endswith(("ch", "sh", "s")):
            verb += "es"
        else:
            verb += "s"
    words = [noun_phrase(rng, plural), verb, noun_phrase(rng, rng.random() < 0.4)]
    if rng.random() < 0.5:
        words += [rng.choice(PREPOSITIONS), noun_phrase(rng, rng.random() < 0.4)]
    if rng.random() < 0.3:
        words.append(rng.choice(ADVERBS))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?"])


def make_corpus():
    rng = random.Random(CORPUS_SEED)
    paragraphs, size = [], 0
    while size < CORPUS_CHARS:
        paragraph = " ".join(sentence(rng) for _ in range(rng.randint(2, 6)))
        paragraphs.append(paragraph)
        size += len(paragraph) + 1
    return "\n".join(paragraphs) + "\n"


def batch_seed(seed, step, rank):
    """A 63-bit generator seed that depends only on (seed, step, rank)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def get_batch(data, step, rank, seed, batch_size, block_size):
    g = torch.Generator()
    g.manual_seed(batch_seed(seed, step, rank))
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=g)
    x = torch.stack([data[i : i + block_size] for i in ix.tolist()])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix.tolist()])
    return x, y


# -----------------------------------------------------------------------------
# Model: nanoGPT without dropout and without biases.


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        assert n_embd % n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, block_size) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        B, T = idx.shape
        pos = torch.arange(T, dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def make_optimizer(model, lr, weight_decay):
    """AdamW; weight decay on matrices only (not on LayerNorm gains), as in nanoGPT."""
    params = list(model.parameters())  # tied weights appear once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def lr_at(step, base_lr, warmup):
    """Learning rate for `step` (1-based): linear warmup, then constant. Depends on the step alone."""
    return base_lr * min(1.0, step / warmup) if warmup > 0 else base_lr


def make_ddp(model):
    """Wrap `model` in DDP with a gradient bucket layout that never changes.

    By default DDP starts with one bucket holding all parameters and, after the first iteration,
    rebuilds its buckets in the order gradients became ready. The all-reduce sums each element in
    an order that depends on where it sits in its bucket, so with three or more ranks the first
    step after a resume (old layout) could differ in the last bit from the same step of an
    uninterrupted run (rebuilt layout). DDP does not rebuild buckets when find_unused_parameters
    is set; the price is one walk over the (small) autograd graph per step, and a one-time warning
    from each rank that no unused parameters were found (expected, harmless).
    """
    return DDP(model, find_unused_parameters=True)


def average_gradients(params, world_size):
    """All-reduce every gradient as one flat tensor (a fixed order: bit-exact across resumes)."""
    grads = [p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(world_size)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


@torch.no_grad()
def evaluate(model, data, step, rank, args):
    """Mean loss on --eval-batches held-out batches (seeded away from the training batches)."""
    model.eval()
    losses = [
        model(
            *get_batch(data, -step * 1000 - i, rank, args.seed, args.batch_size, args.block_size)
        )[1]
        for i in range(args.eval_batches)
    ]
    model.train()
    return torch.stack(losses).mean().item()


# -----------------------------------------------------------------------------
# Checkpoints

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
            f"[train_gpt] warning: rank={RANK} cannot load checkpoint {path}: {type(e).__name__}: {reason}"
        )
        return None


def load_latest_checkpoint(ckpt_dir):
    """The newest usable checkpoint: the one `latest` names, else the newest older one that loads."""
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
            f"[train_gpt] warning: rank={RANK} {latest_file} is missing but checkpoints exist; using the newest that loads"
        )
    except ValueError:
        latest = None
        log(
            f"[train_gpt] warning: rank={RANK} {latest_file} is unreadable; using the newest checkpoint that loads"
        )
    if latest is not None:
        state = try_load(ckpt_dir, latest)
        if state is not None:
            return state
        candidates = [s for s in candidates if s < latest]
        log(
            f"[train_gpt] warning: rank={RANK} falling back from step {latest} to an older checkpoint"
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
            raise  # the controller chose this step for every rank: resuming from another would diverge
        log(f"[train_gpt] warning: rank={RANK} no usable checkpoint ({e}); starting fresh")
        return None
    if state is not None:
        info = engine.last_load
        log(
            f"[train_gpt] restored step={info['step']} rank={RANK} tier={info['tier']} seconds={info['seconds']:.3f}"
        )
    return state


def engine_save(engine, step, model, optimizer, seed, world_size):
    """Every rank: copy its state into checkpoint memory and go on; the rest is in the background."""
    state = {
        "step": step,
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "seed": seed,
        "world_size": world_size,
    }
    handle = engine.save(step, state)
    if not handle.ok:
        log(f"[train_gpt] warning: rank={RANK} checkpoint of step {step} refused: {handle.error}")
    return handle


# -----------------------------------------------------------------------------


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
        default=20,
        metavar="K",
        help="checkpoint every K steps; 0 disables",
    )
    p.add_argument(
        "--ckpt-dir",
        default=os.environ.get("TRANSOM_CHECKPOINT_DIR") or "./checkpoints",
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
        "--step-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="sleep this long after each step (makes a job last longer in tests)",
    )
    return p.parse_args(argv)


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
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)

    # Model and optimizer, then the checkpoint (if any) on top
    torch.manual_seed(args.seed)
    model = GPT(len(chars), args.block_size, args.n_layer, args.n_head, args.n_embd)
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    start_step = 0
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
                f"[train_gpt] warning: rank={rank} checkpoint was written with seed={state.get('seed')} "
                f"world_size={state.get('world_size')}, now seed={args.seed} world_size={world_size}; "
                f"resuming anyway, but not bit-identical to an uninterrupted run"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start_step = state["step"]
        del state
    if distributed:  # all ranks must resume from the same step, or they would silently diverge
        lo, hi = torch.tensor([start_step]), torch.tensor([start_step])
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if lo.item() != hi.item():
            raise RuntimeError(
                f"ranks found different checkpoints (steps {lo.item()}..{hi.item()}); "
                f"is {args.ckpt_dir} shared by all ranks?"
            )
    log(f"[train_gpt] resumed step={start_step} rank={rank} t={time.time():.3f}")

    ddp_model = make_ddp(model) if distributed else model
    last_save = None

    # Training loop. With DDP the gradient all-reduce would overlap backward, so the monitor could not
    # tell compute from communication: backward runs under no_sync() and the gradients are averaged in
    # the monitor's "sync" section, one flat all-reduce in a fixed order (deterministic on resume).
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
            # Never checkpoint poisoned weights (the gradient norm is the same on every rank).
            if (
                args.ckpt_every > 0
                and step % args.ckpt_every == 0
                and math.isfinite(grad_norm.item())
            ):
                with monitor.phase("checkpoint"):
                    if engine is not None:
                        last_save = engine_save(
                            engine, step, model, optimizer, args.seed, world_size
                        )
                    else:
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
                            dist.barrier()  # nobody runs ahead of a checkpoint that is not yet on disk
            if args.eval_every > 0 and step % args.eval_every == 0:
                with monitor.phase("eval"):
                    val = evaluate(model, data, step, rank, args)
                if rank == 0:
                    log(f"eval step {step} loss {val:.4f} t={time.time():.3f}")
            s.report(loss=loss_value, tokens=tokens_per_step)
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
