"""A Hugging Face `Trainer` script with Transom's lines, for `transom run`: `TransomCallback()`
(steps and loss), `TransomCheckpoints()` (the Trainer's checkpoints through transom.checkpoint)
and `resume_from_checkpoint=resume_checkpoint(...)` (the step the controller chose). A tiny
GPT-2 built from a config, synthetic data, DDP over gloo on CPU.

--nan-step N makes rank 1's loss NaN at step N in the first generation only (a blow-up that a
rollback leaves behind); --step-delay slows each step; the final model goes to OUT/final.
"""

import argparse
import math
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from transom.integrations.hf import TransomCallback, TransomCheckpoints, resume_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument(
    "--out", default=os.path.join(os.environ.get("TRANSOM_CHECKPOINT_DIR", "."), "hf")
)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--save-steps", type=int, default=10)
parser.add_argument("--step-delay", type=float, default=0.0)
parser.add_argument("--nan-step", type=int, default=-1)
args = parser.parse_args()
first_generation = os.environ.get("TRANSOM_GENERATION", "1") == "1"
rank = int(os.environ.get("RANK", "0"))

torch.manual_seed(0)
config = GPT2Config(
    vocab_size=64,
    n_positions=16,
    n_embd=32,
    n_layer=2,
    n_head=2,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
model = GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def hook(module, inputs, output):
    if module.training:
        time.sleep(args.step_delay)
        step = trainer.state.global_step + 1
        if first_generation and rank == 1 and step == args.nan_step:
            output["loss"] = output["loss"] * math.nan
    return output


model.register_forward_hook(hook)
training = TrainingArguments(
    output_dir=args.out,
    max_steps=args.steps,
    per_device_train_batch_size=4,
    learning_rate=1e-3,
    logging_steps=1000,
    save_strategy="steps",
    save_steps=args.save_steps,
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
    seed=0,
)
trainer = Trainer(
    model=model,
    args=training,
    train_dataset=Tokens(),
    callbacks=[TransomCallback(), TransomCheckpoints()],
)
trainer.train(resume_from_checkpoint=resume_checkpoint(args.out))
trainer.save_model(os.path.join(args.out, "final"))
print(f"hf done steps={trainer.state.global_step}", flush=True)
