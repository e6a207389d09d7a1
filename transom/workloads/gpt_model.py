"""The example workload's data and model: a synthetic corpus, batches, a nanoGPT in miniature.

Used by transom/workloads/train_gpt.py (see its docstring for the determinism this keeps). This
module must never read the environment or print: the script decides everything.
"""

import hashlib
import math
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
# Data: a synthetic corpus of simple English-like sentences, made from a fixed word list and a
# fixed-seed random generator, so it is the same on every machine and every run. The sentences have
# structure (determiner, adjectives, noun, verb agreeing in number, object, optional phrase) so a
# character-level model has plenty to learn and the loss goes down quickly.

CORPUS_SEED = 1234
CORPUS_CHARS = 300_000
SENTENCE_POOL = 1000  # distinct sentences in the corpus (`make_corpus`)

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
    """CORPUS_CHARS of paragraphs of 2-6 sentences, drawn from SENTENCE_POOL distinct ones: every
    rank makes it as it starts (a restart's critical path), in 8 ms, not the 33 ms of a new
    sentence each time."""
    rng = random.Random(CORPUS_SEED)
    pool = [sentence(rng) for _ in range(SENTENCE_POOL)]
    paragraphs, size = [], 0
    while size < CORPUS_CHARS:
        paragraph = " ".join(rng.choices(pool, k=rng.randint(2, 6)))
        paragraphs.append(paragraph)
        size += len(paragraph) + 1
    return "\n".join(paragraphs) + "\n"


def encode(text, chars):
    """The text as token ids, each character's place in `chars` (which holds every one of them).
    An ASCII text is translated byte by byte: 2 ms for the corpus, not 30 ms, in every rank's
    start-up (a restart's critical path)."""
    if text.isascii() and all(c.isascii() for c in chars):
        table = bytearray(256)
        for i, c in enumerate(chars):
            table[ord(c)] = i
        ids = bytearray(text.encode("ascii").translate(table))
        return torch.frombuffer(ids, dtype=torch.uint8).long()
    stoi = {c: i for i, c in enumerate(chars)}
    return torch.tensor([stoi[c] for c in text], dtype=torch.long)


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
    """Learning rate for `step` (1-based): linear warmup, then constant; a function of the step."""
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
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
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
