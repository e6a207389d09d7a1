"""A Lightning script with Transom's one-liners, for `transom run`: DDP over the nodes Transom
gives it (torchrun's environment), `TransomCallback()`, `TransomCheckpointIO()` and
`ckpt_path=resume_path(...)` (the step the controller chose to restore, or a fresh start).

--nan-step N makes rank 1's loss NaN at step N in the first generation only (a blow-up that a
rollback leaves behind); --snapshots adds `TransomCheckpoints()` (a snapshot every step);
--step-data draws each step's batch from its step and rank (exact after a restore mid-epoch);
the final weights go to TRANSOM_CHECKPOINT_DIR/final.pt.
"""

import argparse
import math
import os
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from transom.integrations.lightning import (
    TransomCallback,
    TransomCheckpointIO,
    TransomCheckpoints,
    resume_path,
)

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--nan-step", type=int, default=-1)
parser.add_argument("--snapshots", action="store_true", help="TransomCheckpoints: every step")
parser.add_argument(
    "--step-data", action="store_true", help="each step's batch drawn from its step and rank"
)
parser.add_argument("--step-delay", type=float, default=0.0)
args = parser.parse_args()
out = os.environ.get("TRANSOM_CHECKPOINT_DIR", ".")
first_generation = os.environ.get("TRANSOM_GENERATION", "1") == "1"


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch, batch_idx):
        if args.step_data:  # data chosen by the step: exact after a restore mid-epoch
            g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
            x = torch.randn(len(batch[0]), 8, generator=g)
            batch = (x, x.sum(dim=1, keepdim=True))
        time.sleep(args.step_delay)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if first_generation and self.global_rank == 1 and self.global_step + 1 == args.nan_step:
            loss = loss * math.nan
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


g = torch.Generator().manual_seed(0)
x = torch.randn(80, 8, generator=g)
data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)  # 5 steps an epoch on 2
torch.manual_seed(0)
model = Regression()
ckpt_dir = os.path.join(out, "lightning")
trainer = pl.Trainer(
    max_steps=args.steps,
    accelerator="cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
    strategy="ddp",
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[
        TransomCallback(),
        *([TransomCheckpoints()] if args.snapshots else []),
        ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=-1),
    ],
    plugins=[TransomCheckpointIO()],
)
trainer.fit(model, loader, ckpt_path=resume_path(ckpt_dir))
if trainer.global_rank == 0:
    torch.save(model.state_dict(), os.path.join(out, "final.pt"))
print(f"lightning done steps={trainer.global_step} rank={trainer.global_rank}", flush=True)
