"""bench/hf.py's job: a 2-rank Hugging Face Trainer run on CPU (gloo) with paced steps.

    --callbacks none | ours            no resiliency callback, or nvrx_hf's NVRxFaultTolerance
    --fault kill --fault-step 15       SIGKILL rank --fault-rank at that global step, once
    --checkpoint-every N               the Trainer saves every N steps; a restarted job resumes
                                       from the last checkpoint (get_last_checkpoint)

The model is one Linear layer whose forward sleeps to --step-time (the work a GPU would do),
so the figure is the Trainer's and the callback's cost around a step, not CPU arithmetic.
Appends JSON lines {"t", "ev", "pid", ...} to WORKDIR/timeline.jsonl: started (after the
checkpoint was loaded), fault, done, and one "steps" record per rank at the end with every
step's end time (kept in memory while training) and, with --callbacks ours, the seconds the
callback spent in its hooks during training. With --record-each-step every step is also
appended as it ends (the restart figure needs the first step after a restart).
"""

import argparse
import json
import os
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--callbacks", choices=("none", "ours"), default="none")
p.add_argument("--fault", choices=("none", "kill"), default="none")
p.add_argument("--fault-step", type=int, default=15)
p.add_argument("--fault-rank", type=int, default=1)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--checkpoint-every", type=int, default=0)
p.add_argument("--record-each-step", action="store_true")
p.add_argument("--workdir", required=True)
args = p.parse_args()

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402 - after argument errors
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

timeline = os.path.join(args.workdir, "timeline.jsonl")
marker = os.path.join(args.workdir, "fault.marker")
rank = int(os.environ.get("RANK", 0))


def record(ev, **fields):
    line = json.dumps({"t": time.time(), "ev": ev, "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(timeline, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, line.encode())
    os.close(fd)


class PacedModel(torch.nn.Module):
    """A Linear layer; the forward sleeps to `step_time`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(256, 256)

    def forward(self, x):
        t0 = time.monotonic()
        loss = self.layer(x).square().mean()
        time.sleep(max(0.0, args.step_time - (time.monotonic() - t0)))
        return {"loss": loss}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 256, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"x": self.x[index]}


class HookTimer:
    """The time a callback spends in its hooks while training runs (every on_* but the ones
    around the whole run: train begin/end, init end). The overhead figure subtracts two noisy
    step intervals; this measures the callback's own share of a step directly."""

    AROUND_THE_RUN = ("on_init_end", "on_train_begin", "on_train_end")

    def __init__(self, callback):
        self.seconds = 0.0
        self.by_hook = {}
        for name in dir(type(callback)):
            if name.startswith("on_") and name not in self.AROUND_THE_RUN:
                setattr(callback, name, self._timed(name, getattr(callback, name)))

    def _timed(self, name, hook):
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                spent = time.perf_counter() - began
                self.seconds += spent
                self.by_hook[name] = self.by_hook.get(name, 0.0) + spent
        return timed


class StepClock(TrainerCallback):
    """Step end times (in memory), the injected fault, and the timed callback's hook time."""

    def __init__(self, hook_timer=None):
        self.ends = []
        self.hook_timer = hook_timer

    def on_train_begin(self, a, state, control, **kwargs):
        record("started", rank=rank, step=state.global_step)

    def on_step_end(self, a, state, control, **kwargs):
        self.ends.append(time.time())
        if args.record_each_step:
            record("step", rank=rank, step=state.global_step)
        if (args.fault == "kill" and rank == args.fault_rank and state.global_step == args.fault_step
                and not os.path.exists(marker)):
            open(marker, "w").close()
            record("fault", rank=rank, step=state.global_step)
            os.kill(os.getpid(), 9)

    def on_train_end(self, a, state, control, **kwargs):
        timer = self.hook_timer
        record("steps", rank=rank, ends=self.ends, hook_seconds=timer and timer.seconds,
               hook_seconds_by_name=timer and timer.by_hook)


def main():
    torch.set_num_threads(1)
    callbacks = []
    if args.callbacks == "ours":
        from nvrx_hf.fault_tolerance import NVRxFaultTolerance

        ours = NVRxFaultTolerance()
        callbacks = [StepClock(HookTimer(ours)), ours]
    else:
        callbacks = [StepClock()]
    output_dir = os.path.join(args.workdir, "out")
    training = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=0.01,
        save_strategy="steps" if args.checkpoint_every else "no", save_steps=args.checkpoint_every or 500,
        logging_steps=10_000, report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, remove_unused_columns=False, ddp_find_unused_parameters=False)
    trainer = Trainer(model=PacedModel(), args=training, train_dataset=Rows(args.steps * 8), callbacks=callbacks)
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    trainer.train(resume_from_checkpoint=last)
    record("done", rank=rank)


if __name__ == "__main__":
    main()
