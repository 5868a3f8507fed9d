"""bench/lightning_adapter.py's job: a 2-rank Lightning DDP fit on CPU (gloo) with paced steps.

    --callbacks none | ours | peer     no resiliency callbacks, nvrx_lightning's four, or
                                       nvidia-resiliency-ext 0.4.1's FaultToleranceCallback
    --fault kill --fault-step 15       SIGKILL rank --fault-rank at that global step, once
    --checkpoint-every N               ModelCheckpoint every N steps, resumed with ckpt_path="last"

Appends JSON lines {"t", "ev", ...} to WORKDIR/timeline.jsonl: started, fault, done, and one
"steps" record per rank at the end with every step's end time (kept in memory while
training, so timing them costs the loop nothing it would not cost without callbacks).
With --record-each-step, every step is also appended as it ends (the recovery figure needs
the first step after a restart even if the job then fails).
"""

import argparse
import json
import os
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--callbacks", choices=("none", "ours", "peer", "ft", "straggler", "preemption"), default="none",
               help="ft / straggler / preemption: one of ours alone (to find what a cost comes from)")
p.add_argument("--fault", choices=("none", "kill"), default="none")
p.add_argument("--fault-step", type=int, default=15)
p.add_argument("--fault-rank", type=int, default=1)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--checkpoint-every", type=int, default=0)
p.add_argument("--record-each-step", action="store_true")
p.add_argument("--workdir", required=True)
args = p.parse_args()

import lightning.pytorch as pl  # noqa: E402 - after argument errors, like a user script

timeline = os.path.join(args.workdir, "timeline.jsonl")
marker = os.path.join(args.workdir, "fault.marker")


def record(ev, **fields):
    line = json.dumps({"t": time.time(), "ev": ev, "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(timeline, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, line.encode())
    os.close(fd)


class PacedModel(pl.LightningModule):
    """A small Linear layer; each step sleeps to `step_time` (the work a GPU would do)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(256, 256)

    def training_step(self, batch, batch_idx):
        t0 = time.monotonic()
        loss = self.layer(batch).square().mean()
        time.sleep(max(0.0, args.step_time - (time.monotonic() - t0)))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(args.steps * 4, 256), batch_size=4)


class StepClock(pl.Callback):
    """Step end times (in memory) and the injected fault."""

    def __init__(self):
        self.ends = []

    def on_train_start(self, trainer, pl_module):
        record("started", rank=trainer.global_rank, step=trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.time()
        self.ends.append(now)
        if args.record_each_step:
            record("step", rank=trainer.global_rank, step=trainer.global_step)
        if (args.fault == "kill" and trainer.global_rank == args.fault_rank and trainer.global_step == args.fault_step
                and not os.path.exists(marker)):
            open(marker, "w").close()
            record("fault", rank=trainer.global_rank, step=trainer.global_step)
            os.kill(os.getpid(), 9)

    def on_train_end(self, trainer, pl_module):
        record("steps", rank=trainer.global_rank, ends=self.ends)


def resiliency_callbacks():
    if args.callbacks in ("ours", "ft", "straggler", "preemption"):
        from nvrx_lightning import NVRxFaultTolerance, NVRxPreemption, NVRxStragglerDetection

        ours = {"ft": NVRxFaultTolerance, "straggler": NVRxStragglerDetection, "preemption": NVRxPreemption}
        if args.callbacks != "ours":
            return [ours[args.callbacks]()], []
        return [make() for make in ours.values()], ["nvrx_async_io"]
    if args.callbacks == "peer":
        from nvidia_resiliency_ext.ptl_resiliency import FaultToleranceCallback

        return [FaultToleranceCallback(autoresume=False, calculate_timeouts=False)], []
    return [], []


callbacks, plugins = resiliency_callbacks()
if plugins:
    from nvrx_lightning import NVRxAsyncCheckpointIO

    plugins = [NVRxAsyncCheckpointIO()]
if args.checkpoint_every:
    callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=os.path.join(args.workdir, "ckpt"), save_last=True,
                                                  every_n_train_steps=args.checkpoint_every))
trainer = pl.Trainer(
    accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), strategy="ddp",
    max_steps=args.steps, callbacks=[StepClock(), *callbacks], plugins=plugins, default_root_dir=args.workdir,
    enable_checkpointing=bool(args.checkpoint_every), logger=False, enable_progress_bar=False,
    enable_model_summary=False, num_sanity_val_steps=0,
)
trainer.fit(PacedModel(), ckpt_path="last" if args.checkpoint_every else None)
record("done", rank=trainer.global_rank)
