"""A Lightning DDP fit (CPU, gloo) with NVRxFaultTolerance, run by ft_launcher in the tests.

    ft_launcher --nproc-per-node 2 ... lightning_ft_job.py --root DIR --max-steps 30
        [--fault KIND:RANK:STEP:CYCLE]...   (the first through the callback, the others here)

Each step's data is a function of (global step, rank), so a job resumed from any
checkpoint computes exactly what an uninterrupted one does. At the end every rank writes
DIR/result.rank<R>.json: its global step and a hash of its weights.
"""

import argparse
import hashlib
import json
import os
import sys
import time

import torch

from nvrx_core.ft.faults import FaultInjector, SimulatedFault
from nvrx_lightning import NVRxFaultTolerance
from nvrx_lightning._compat import Callback, LightningModule, Trainer, pl


def parse_fault(text):
    kind, rank, step, cycle = text.split(":")
    return SimulatedFault(kind, rank_to_fail=int(rank), at_iteration=int(step), cycle=int(cycle))


class Model(LightningModule):
    def __init__(self, step_time):
        super().__init__()
        self.layer = torch.nn.Linear(16, 4)
        self.step_time = step_time

    def training_step(self, batch, batch_idx):
        seed = self.trainer.global_step * 1000 + self.global_rank
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
        time.sleep(self.step_time)
        return self.layer(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(10_000, 1), batch_size=1)


class ExtraFaults(Callback):
    """Faults in later restart cycles, injected the way the callback injects its own (this
    callback runs first: inside the callback's 'step' section)."""

    def __init__(self, faults):
        self.faults = faults
        self.injectors = []

    def setup(self, trainer, pl_module, stage):
        self.injectors = [FaultInjector(f, rank=trainer.global_rank, world_size=trainer.world_size)
                          for f in self.faults]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for injector in self.injectors:
            injector.maybe_inject(trainer.global_step)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--fault", action="append", default=[])
    args = parser.parse_args()

    faults = [parse_fault(f) for f in args.fault]
    pl.seed_everything(0, verbose=False)
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(args.root, "ckpt"), save_last=True,
                                               every_n_train_steps=args.every, save_top_k=-1)
    ft = NVRxFaultTolerance(simulated_fault=faults[0] if faults else None)
    trainer = Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), strategy="ddp",
        max_steps=args.max_steps, callbacks=[ExtraFaults(faults[1:]), ft, checkpoints],
        default_root_dir=args.root, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = Model(args.step_time)
    trainer.fit(model, ckpt_path="last")
    weights = b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())
    result = {"global_step": trainer.global_step, "weights": hashlib.sha256(weights).hexdigest(),
              "cycle": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}
    with open(os.path.join(args.root, f"result.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
