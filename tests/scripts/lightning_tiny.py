"""A Lightning script with Transom's one-liners: `TransomCallback()` in the callbacks and
`TransomCheckpointIO()` in the plugins; a tiny regression model on synthetic data, CPU.

--ckpt-every N saves a checkpoint every N steps (ModelCheckpoint, through the plugin);
--resume-step S resumes from the checkpoint of step S; --nan-step N makes the loss NaN at
training step N; --snapshots adds `TransomCheckpoints()` (a snapshot every step); --step-data
draws each step's batch from its step number; the final weights go to --weights.
"""

import argparse
import math
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from transom import checkpoint
from transom.integrations.lightning import (
    TransomCallback,
    TransomCheckpointIO,
    TransomCheckpoints,
    write_marker,
)

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--ckpt-every", type=int, default=0)
parser.add_argument("--resume-step", type=int, default=-1)
parser.add_argument("--nan-step", type=int, default=-1)
parser.add_argument("--snapshots", action="store_true", help="TransomCheckpoints: every step")
parser.add_argument(
    "--step-data", action="store_true", help="each step's batch drawn from its step and rank"
)
parser.add_argument("--weights", default="")
args = parser.parse_args()


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.calls = 0

    def training_step(self, batch, batch_idx):
        if args.step_data:  # data chosen by the step: exact after a restore mid-epoch
            g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
            x = torch.randn(len(batch[0]), 8, generator=g)
            batch = (x, x.sum(dim=1, keepdim=True))
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_step + 1 == args.nan_step:
            loss = loss * math.nan
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


g = torch.Generator().manual_seed(0)
x = torch.randn(80, 8, generator=g)
data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=False)  # 5 steps an epoch
torch.manual_seed(0)
model = Regression()
callbacks = [TransomCallback(), *([TransomCheckpoints()] if args.snapshots else [])]
if args.ckpt_every:
    callbacks.append(
        ModelCheckpoint(dirpath=args.dir, every_n_train_steps=args.ckpt_every, save_top_k=-1)
    )
engine = checkpoint.Engine(storage_dir=os.path.join(args.dir, "storage"))
trainer = pl.Trainer(
    max_steps=args.steps,
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=callbacks,
    plugins=[TransomCheckpointIO(engine)],
)
ckpt_path = None
if args.resume_step >= 0:
    ckpt_path = os.path.join(args.dir, "resume.ckpt")
    write_marker(Path(ckpt_path), args.resume_step)
trainer.fit(model, loader, ckpt_path=ckpt_path)
if args.weights:
    torch.save(model.state_dict(), args.weights)
engine.close()
print(f"lightning done steps={trainer.global_step}", flush=True)
