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
import hashlib
import os
from typing import Optional

import torch

from nvrx_core.durable import atomic_write_json
from nvrx_core.ft.faults import FaultInjector, SimulatedFault
from nvrx_lightning import NVRxAsyncCheckpointIO, NVRxFaultTolerance, NVRxPreemption, NVRxStragglerDetection
from nvrx_lightning._compat import LightningModule, Trainer, pl


class Regression(LightningModule):
    """Each step's batch is a function of (global step, rank), so a job resumed from any
    checkpoint computes exactly what an uninterrupted one does (a shuffled DataLoader would
    restart its epoch on resume)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        gen = torch.Generator().manual_seed(self.trainer.global_step * 1000 + self.global_rank)
        x = torch.randn(32, 32, generator=gen)
        return torch.nn.functional.mse_loss(self.net(x), x.sum(dim=1, keepdim=True))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(1_000_000, 1), batch_size=1)  # steps, not data


class KillOnce(pl.Callback):
    """Rehearsal: SIGKILL one rank at one step of the first cycle (`--kill-at RANK:STEP`)."""

    def __init__(self, spec: str):
        rank, step = (int(x) for x in spec.split(":"))
        self.injector = FaultInjector(SimulatedFault("rank_killed", rank_to_fail=rank, at_iteration=step))

    def on_train_batch_end(self, trainer, *args):
        self.injector.maybe_inject(trainer.global_step)


def fit(trainer: Trainer, root: str, kill_at: Optional[str] = None, result_dir: Optional[str] = None,
        seed: int = 1234) -> None:
    """Fit the model with `trainer`, resuming from `root`'s last checkpoint: a function of the
    trainer, so NeMo-Run can run it as `run.Partial(fit, trainer=run.Config(Trainer, ...))` and
    its plugins can add callbacks to that trainer."""
    if kill_at:
        trainer.callbacks.append(KillOnce(kill_at))
    pl.seed_everything(seed)
    model = Regression()
    trainer.fit(model, ckpt_path="last")
    if result_dir:
        weights = b"".join(t.detach().cpu().numpy().tobytes() for t in model.state_dict().values())
        os.makedirs(result_dir, exist_ok=True)
        atomic_write_json(os.path.join(result_dir, f"result{trainer.global_rank}.json"),
                          {"global_step": trainer.global_step, "weights": hashlib.sha256(weights).hexdigest(),
                           "cycle": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))})


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
    fit(trainer, args.root)


if __name__ == "__main__":
    main()
