"""A Hugging Face `Trainer` script with Transom's one line (`callbacks=[TransomCallback()]`): a
tiny GPT-2 built from a config (nothing downloaded), a synthetic dataset, CPU.

--nan-step N makes the model's loss NaN at training step N (a forward hook of the test's own),
as a numerical blow-up would; --eval-steps N evaluates every N steps on samples each
--eval-delay S seconds to load (a slow validation set).
"""

import argparse
import math
import time

from hf_parts import Tokens, tiny_gpt2
from transformers import Trainer, TrainingArguments

from transom.integrations.hf import TransomCallback

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--nan-step", type=int, default=-1)
parser.add_argument("--eval-steps", type=int, default=0)
parser.add_argument("--eval-delay", type=float, default=0.0)
args = parser.parse_args()

model = tiny_gpt2()


forwards = 0


def blow_up(module, inputs, output):
    global forwards
    if module.training:
        forwards += 1
        if forwards == args.nan_step:
            output["loss"] = output["loss"] * math.nan
    return output


model.register_forward_hook(blow_up)


class SlowTokens(Tokens):
    def __getitem__(self, i):
        time.sleep(args.eval_delay)
        return super().__getitem__(i)


training = TrainingArguments(
    output_dir=args.out,
    max_steps=args.steps,
    per_device_train_batch_size=4,
    learning_rate=1e-3,
    logging_steps=1000,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
    eval_strategy="steps" if args.eval_steps else "no",
    eval_steps=args.eval_steps or None,
    per_device_eval_batch_size=4,
    prediction_loss_only=True,
)
trainer = Trainer(
    model=model,
    args=training,
    train_dataset=Tokens(),
    eval_dataset=SlowTokens(8) if args.eval_steps else None,
    callbacks=[TransomCallback()],
)
trainer.train()
print(f"hf done steps={trainer.state.global_step}", flush=True)
