"""A plain Hugging Face `Trainer` script: no Transom import, nothing Transom-specific.

It is what a user brings: a small GPT-2 built from a config (nothing downloaded), synthetic
token data, CPU, the stock Trainer (under torchrun-style environment variables it runs DDP over
gloo), resuming from its own last checkpoint on disk (`get_last_checkpoint`), as such scripts
do. Run it like any script:

    torchrun --nproc-per-node 2 examples/hf_trainer_unmodified.py --steps 100
    transom run --nnodes 2 examples/hf_trainer_unmodified.py --steps 100

Under `transom run` the worker bootstrap instruments it without a change (docs/integrations.md),
so hangs and stragglers are found in it (`python -m benchmarks.detection --script hf`; the
one-line integration with the Trainer's own step numbers is transom.integrations.hf).

A step is a few tens of milliseconds on one CPU thread (the default --width 64, 2 layers,
sequences of 64 tokens, 8 a batch). --data-delay S makes each batch take S seconds more to arrive
(the data collator waits), as a data pipeline would. --eval-steps N evaluates on 64 held-out
samples every N steps, each of them --eval-delay S seconds to load (a slow validation set).
--after-save-s S makes the main process write sample completions from the model for S seconds
after each save (a plain callback, as scripts do to watch a run), while the other ranks wait for
it in the next step's all-reduce. A plain `TrainerCallback` prints `step N t=TIME` on the main
process after each step (N the Trainer's global step, TIME time.time()) and `eval step N loss L`
after each evaluation; the final model goes to OUT/final.
"""

import argparse
import os
import time

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)
from transformers.trainer_utils import get_last_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument(
    "--out", default=os.path.join(os.environ.get("TRANSOM_CHECKPOINT_DIR", "."), "hf")
)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--save-steps", type=int, default=10)
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--data-delay", type=float, default=0.0)
parser.add_argument("--eval-steps", type=int, default=0)
parser.add_argument("--eval-delay", type=float, default=0.0)
parser.add_argument("--after-save-s", type=float, default=0.0)
args = parser.parse_args()

VOCAB, LENGTH = 256, 64
torch.manual_seed(0)
config = GPT2Config(
    vocab_size=VOCAB,
    n_positions=LENGTH,
    n_embd=args.width,
    n_layer=args.layers,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
)
model = GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """Sample i: LENGTH token ids, a function of i alone."""

    def __len__(self):
        return 1_000_000

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class HeldOut(Tokens):
    """64 samples, none of the training set's first million, each slow to load."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(args.eval_delay)
        return super().__getitem__(1_000_000 + i)


def collate(samples):
    time.sleep(args.data_delay)
    return default_data_collator(samples)


class PrintSteps(TrainerCallback):
    def on_step_end(self, training_args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"step {state.global_step} t={time.time():.3f}", flush=True)

    def on_evaluate(self, training_args, state, control, metrics=None, **kwargs):
        if state.is_world_process_zero:
            loss = (metrics or {}).get("eval_loss", float("nan"))
            print(f"eval step {state.global_step} loss {loss:.4f}", flush=True)


class WriteSamples(TrainerCallback):
    """After each save, the main process writes sample completions for --after-save-s seconds."""

    def on_save(self, training_args, state, control, model=None, **kwargs):
        if not (state.is_world_process_zero and args.after_save_s and model is not None):
            return
        until, written = time.monotonic() + args.after_save_s, 0
        prompt = torch.zeros((1, 4), dtype=torch.long)
        with torch.no_grad():
            while time.monotonic() < until:
                model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
                written += 1
        print(f"samples after step {state.global_step}: {written}", flush=True)


training = TrainingArguments(
    output_dir=args.out,
    max_steps=args.steps,
    per_device_train_batch_size=8,
    learning_rate=1e-3,
    logging_steps=50,
    save_strategy="steps",
    save_steps=args.save_steps,
    eval_strategy="steps" if args.eval_steps else "no",
    eval_steps=args.eval_steps or None,
    per_device_eval_batch_size=8,
    prediction_loss_only=True,
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
    seed=0,
    ddp_find_unused_parameters=False,
)
trainer = Trainer(
    model=model,
    args=training,
    train_dataset=Tokens(),
    eval_dataset=HeldOut() if args.eval_steps else None,
    data_collator=collate,
    callbacks=[PrintSteps(), WriteSamples()],
)
last = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
print(f"resuming from {last}", flush=True)
trainer.train(resume_from_checkpoint=last)
trainer.save_model(os.path.join(args.out, "final"))
print(f"hf done steps={trainer.state.global_step}", flush=True)
