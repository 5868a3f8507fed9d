"""A Lightning job with NVRxPreemption, for tests/test_lightning_preemption.py.

Run as a CPU DDP job under a launcher or with the torchelastic variables set by the test,
or imported by the test for single-process runs. Each step's batch is drawn from a
generator seeded by (global step, rank), so the data a step sees depends on the step
alone: a run resumed from a mid-epoch checkpoint trains on exactly what an uninterrupted
run does, and the test checks what the checkpoint holds, not how Lightning's dataloaders
resume.

Writes into --out: progress.rank<R> ({"pid", "step", "start_step"} after every batch; the
test signals that pid), and when fit returns or raises SystemExit, result.rank<R>.json and,
after a completed fit, final.rank<R>.pt (the weights).
"""

import argparse
import os
import signal
import sys
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from nvrx_core.durable import atomic_write_json
from nvrx_lightning.preemption import NVRxPreemption

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for the harness
from harness import wait_for  # noqa: E402


class Indices(Dataset):
    def __len__(self):
        return 1_000_000

    def __getitem__(self, index):
        return index


class StepSeededNet(pl.LightningModule):
    def __init__(self, pace_s=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.pace_s = pace_s

    def training_step(self, batch, batch_idx):
        generator = torch.Generator().manual_seed(self.global_step * 1000 + self.global_rank)
        x = torch.randn(16, 8, generator=generator)
        if self.pace_s:
            time.sleep(self.pace_s)  # leaves the test a window to signal mid-training
        return (self.net(x) - x.sum(dim=1, keepdim=True).sin()).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(Indices(), batch_size=1)


class Progress(pl.Callback):
    """Publishes this rank's pid and global step after every batch. With `wait_at`, rank 1
    (the rank the tests signal) then waits at that step until its SIGTERM has arrived, so the
    run cannot end before the signal however late the test sends it."""

    def __init__(self, out, rank, wait_at=None, preemption=None):
        self.path = os.path.join(out, f"progress.rank{rank}")
        self.start_step = None
        self.wait_at = wait_at if rank == 1 else None
        self.preemption = preemption

    def on_train_start(self, trainer, pl_module):
        self.start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        atomic_write_json(self.path, {"pid": os.getpid(), "step": trainer.global_step, "start_step": self.start_step})
        if trainer.global_step == self.wait_at:
            wait_for(lambda: self.preemption.received, 120, f"the test's SIGTERM to rank 1 at step {self.wait_at}")


def make_trainer(out, world, max_steps, callbacks):
    return pl.Trainer(
        accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", max_steps=max_steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=out, callbacks=callbacks,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--check-every", type=int, default=4)
    p.add_argument("--pace-s", type=float, default=0.03)
    p.add_argument("--ckpt-dir", default=None, help="the ModelCheckpoint's dirpath (default: OUT/ckpt)")
    p.add_argument("--resume", action="store_true", help='fit(ckpt_path="last")')
    p.add_argument("--wait-for-sigterm-at", type=int, default=None,
                   help="rank 1 waits at the end of this global step until it has received SIGTERM")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    preemption = NVRxPreemption(check_every_n_steps=args.check_every)
    progress = Progress(args.out, rank, args.wait_for_sigterm_at, preemption)
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir or os.path.join(args.out, "ckpt"),
                                                 save_top_k=0)
    trainer = make_trainer(args.out, world, args.max_steps, [preemption, progress, checkpoints])
    model = StepSeededNet(args.pace_s)
    before = signal.getsignal(signal.SIGTERM)
    result = {"rank": rank}
    try:
        trainer.fit(model, ckpt_path="last" if args.resume else None)
        result["exit"] = 0
        torch.save(model.state_dict(), os.path.join(args.out, f"final.rank{rank}.pt"))
    except SystemExit as e:
        result["exit"] = e.code
        raise
    finally:
        result.update(
            global_step=trainer.global_step, start_step=progress.start_step, stopped_at=preemption.stopped_at_step,
            signals=[signal.Signals(n).name for n in preemption.received],
            handler_restored=signal.getsignal(signal.SIGTERM) is before,
        )
        atomic_write_json(os.path.join(args.out, f"result.rank{rank}.json"), result)


if __name__ == "__main__":
    main()
