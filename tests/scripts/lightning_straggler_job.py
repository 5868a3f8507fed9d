"""A Lightning job with NVRxStragglerDetection, for tests/test_lightning_straggler.py.

Run under a launcher (ft_launcher or torchrun: Lightning reads the torchelastic variables)
as a CPU DDP job, or imported by the test for single-process runs. A step's forward
(training_step, which the callback times) takes --step-s, --slow-factor times longer on
--slow-rank. Run as a job, on recorded timings: the detector's clock and timer are a
FakeClock (tests/harness) that training_step advances by that much, so which rank is slow,
and its score, are decided by the durations given, never by how late a loaded host woke a
sleeping rank; the Trainer, DDP and the ranks are real. Imported, the forward sleeps.

Writes into --out: metrics.rank<R>.jsonl (every logged metrics dict, from the recording
logger) and, when fit ends or raises SystemExit, result.rank<R>.json.
"""

import argparse
import functools
import json
import os
import sys
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from nvrx_core.durable import atomic_write_json
from nvrx_core.straggler import Detector
from nvrx_lightning import straggler as lightning_straggler
from nvrx_lightning.straggler import NVRxStragglerDetection


class Indices(Dataset):
    def __len__(self):
        return 1_000_000

    def __getitem__(self, index):
        return index


class SleepyNet(pl.LightningModule):
    """Tiny regression; the forward spends `step_s` (times `slow_factor` on `slow_rank`):
    `spend(seconds)` sleeps by default, or advances a recorded timeline's clock."""

    def __init__(self, step_s=0.01, slow_rank=-1, slow_factor=1.0, spend=time.sleep):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 1)
        self.step_s, self.slow_rank, self.slow_factor, self.spend = step_s, slow_rank, slow_factor, spend

    def training_step(self, batch, batch_idx):
        slow = self.slow_factor if self.global_rank == self.slow_rank else 1.0
        self.spend(self.step_s * slow)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(self.global_step))
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(Indices(), batch_size=1)


class RecordingLogger(pl.loggers.Logger):
    """Appends every metrics dict Lightning hands to its loggers to a JSON-lines file."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")


def make_trainer(out, world, max_steps, callbacks, rank=0):
    return pl.Trainer(
        accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", max_steps=max_steps,
        logger=RecordingLogger(os.path.join(out, f"metrics.rank{rank}.jsonl")), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, default_root_dir=out, callbacks=callbacks,
    )


def main():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for the harness
    from harness.clock import FakeClock

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=2000)
    p.add_argument("--step-s", type=float, default=0.02)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-factor", type=float, default=1.4)
    p.add_argument("--report-time-interval", type=float, default=0.5)
    p.add_argument("--threshold", type=float, default=0.8)
    p.add_argument("--stop-if-detected", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    detection = NVRxStragglerDetection(
        report_time_interval=args.report_time_interval, num_gpu_perf_scores_to_print=0,
        gpu_relative_perf_threshold=args.threshold, gpu_individual_perf_threshold=args.threshold,
        stop_if_detected=args.stop_if_detected, dirpath=os.path.join(args.out, "ckpt"),
    )
    clock = FakeClock()  # the callback's Detector reads it (it has no clock argument of its own)
    lightning_straggler.Detector = functools.partial(Detector, clock=clock, timer=clock)
    trainer = make_trainer(args.out, world, args.max_steps, [detection], rank)
    model = SleepyNet(args.step_s, args.slow_rank, args.slow_factor, spend=clock.advance)
    result = {"rank": rank}
    try:
        trainer.fit(model)
        result["exit"] = 0
    except SystemExit as e:
        result["exit"] = e.code
        raise
    finally:
        report = detection.last_report
        result.update(
            global_step=trainer.global_step, reports=detection.report_count,
            last_report=None if report is None else report.index,
            flagged=None if report is None else list(report.flagged_ranks),
            unwrapped="training_step" not in vars(trainer.strategy),
        )
        atomic_write_json(os.path.join(args.out, f"result.rank{rank}.json"), result)


if __name__ == "__main__":
    main()
