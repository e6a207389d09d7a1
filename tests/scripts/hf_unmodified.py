"""An unmodified Hugging Face `Trainer` script (no transom import): a tiny GPT-2 built from a
config (nothing downloaded), synthetic data, CPU, resuming from its own last checkpoint on disk
(`get_last_checkpoint`), as such scripts do. Under torchrun-style environment variables the
Trainer runs DDP over gloo.

--step-delay makes each training step that much longer (a forward hook), so a test can stop a
rank mid-run; the final model goes to OUT/final.
"""

import argparse
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument(
    "--out", default=os.path.join(os.environ.get("TRANSOM_CHECKPOINT_DIR", "."), "hf")
)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--save-steps", type=int, default=10)
parser.add_argument("--step-delay", type=float, default=0.0)
args = parser.parse_args()

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


def slow(module, inputs, output):
    if module.training:
        time.sleep(args.step_delay)


model.register_forward_hook(slow)
training = TrainingArguments(
    output_dir=args.out,
    max_steps=args.steps,
    per_device_train_batch_size=4,
    learning_rate=1e-3,
    logging_steps=5,
    save_strategy="steps",
    save_steps=args.save_steps,
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
    seed=0,
)
trainer = Trainer(model=model, args=training, train_dataset=Tokens())
last = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
print(f"resuming from {last}", flush=True)
trainer.train(resume_from_checkpoint=last)
trainer.save_model(os.path.join(args.out, "final"))
print(f"hf done steps={trainer.state.global_step}", flush=True)
