"""A Lightning fit with every nvrx_lightning part turned on (CPU, gloo; runs as is on GPUs).

    ft_launcher --nproc-per-node 2 --max-restarts 3 \
        --warm-start-preload lightning.pytorch,nvrx_lightning \
        examples/lightning_ft.py --root /tmp/lightning_ft

Kill a rank (`pkill -9 -f lightning_ft.py` hits one at random), stop one with SIGSTOP, or
send SIGTERM to one: the job resumes from the last checkpoint, or stops every rank at the
same step, checkpoints and exits 18. Under plain `python` or torchrun it trains too; fault
tolerance then says once that it is inactive.
"""

import argparse
import os

import torch

from nvrx_lightning import NVRxAsyncCheckpointIO, NVRxFaultTolerance, NVRxPreemption, NVRxStragglerDetection
from nvrx_lightning._compat import LightningModule, Trainer, pl


class Regression(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        x = torch.randn(4096, 32, generator=torch.Generator().manual_seed(0))
        y = x.sum(dim=1, keepdim=True)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="lightning_ft")
    parser.add_argument("--max-steps", type=int, default=2000)
    args = parser.parse_args()

    trainer = Trainer(
        accelerator="auto", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), strategy="ddp",
        max_steps=args.max_steps, default_root_dir=args.root,
        callbacks=[
            NVRxFaultTolerance(),                                   # hangs and crashes -> restart
            NVRxStragglerDetection(report_time_interval=60),       # names a slow rank
            NVRxPreemption(),                                       # SIGTERM -> same step, save, exit 18
            pl.callbacks.ModelCheckpoint(dirpath=os.path.join(args.root, "checkpoints"), save_last=True,
                                         every_n_train_steps=100),
        ],
        plugins=[NVRxAsyncCheckpointIO()],                          # saves block only for the snapshot
    )
    trainer.fit(Regression(), ckpt_path="last")


if __name__ == "__main__":
    main()
