"""A Hugging Face Trainer job with NVRxPreemption, for tests/test_hf_preemption.py.

Run as a 2-rank CPU job (gloo) under ft_launcher or with the torchelastic variables the
test sets. Writes into --out: progress.rank<R> (hf_tiny.Progress), saved.rank<R>.json (see
SavedRecord), and when train() returns
or raises SystemExit, result.rank<R>.json; after a completed train(), final.rank<R>.pt (the
weights). Checkpoints go where the Trainer puts them: --out/checkpoint-<step> (or
--output-dir); --resume continues from the last one there (resume_from_checkpoint=True).
"""

import argparse
import os
import signal
import sys

import torch
from transformers import Trainer, TrainerCallback

from hf_tiny import Progress, Tokens, rank_and_world, tiny_model, training_args
from nvrx_core.durable import atomic_write_json
from nvrx_hf import NVRxPreemption

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for the harness
from harness import wait_for  # noqa: E402


class SavedRecord(TrainerCallback):
    """In on_save of the stop's checkpoint (listed before NVRxPreemption, so before its barrier,
    which no rank passes until every rank is here): the step and the signals this rank got.
    Unlike the result file, it cannot be cut short by the launcher stopping the job."""

    def __init__(self, out, rank, preemption):
        self.path = os.path.join(out, f"saved.rank{rank}.json")
        self.preemption = preemption

    def on_save(self, args, state, control, **kwargs):
        if self.preemption.stopped_at_step is not None:
            atomic_write_json(self.path, {"step": state.global_step,
                                          "signals": [signal.Signals(n).name for n in self.preemption.received]})


class WaitForSigterm(TrainerCallback):
    """Rank 1 (the rank the test signals) waits at the end of global step `step`, after
    Progress has published it, until its SIGTERM has arrived: the run cannot end before the
    signal however late the test sends it."""

    def __init__(self, rank, step, preemption):
        self.step = step if rank == 1 else None
        self.preemption = preemption

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step:
            return
        wait_for(lambda: self.preemption.received, 120, f"the test's SIGTERM to rank 1 at step {self.step}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default: --out)")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--check-every", type=int, default=4)
    p.add_argument("--pace-s", type=float, default=0.0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--wait-for-sigterm-at", type=int, default=None,
                   help="rank 1 waits at the end of this global step until it has received SIGTERM")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, _ = rank_and_world()
    preemption = NVRxPreemption(check_every_n_steps=args.check_every)
    progress = Progress(args.out, rank, args.pace_s)
    model = tiny_model()
    trainer = Trainer(model=model, args=training_args(args.output_dir or args.out, args.max_steps),
                      train_dataset=Tokens(),
                      callbacks=[SavedRecord(args.out, rank, preemption), preemption, progress,
                                 WaitForSigterm(rank, args.wait_for_sigterm_at, preemption)])
    before = signal.getsignal(signal.SIGTERM)
    result = {"rank": rank}
    try:
        trainer.train(resume_from_checkpoint=True if args.resume else None)
        result["exit"] = 0
        torch.save(model.state_dict(), os.path.join(args.out, f"final.rank{rank}.pt"))
    except SystemExit as e:
        result["exit"] = e.code
        raise
    finally:
        result.update(
            global_step=trainer.state.global_step, start_step=progress.start_step,
            stopped_at=preemption.stopped_at_step, signals=[signal.Signals(n).name for n in preemption.received],
            handler_restored=signal.getsignal(signal.SIGTERM) is before,
        )
        atomic_write_json(os.path.join(args.out, f"result.rank{rank}.json"), result)


if __name__ == "__main__":
    main()
