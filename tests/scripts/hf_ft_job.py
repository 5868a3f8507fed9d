"""A Hugging Face Trainer run (2 CPU ranks, gloo) with NVRxFaultTolerance, run by ft_launcher.

    ft_launcher --nproc-per-node 2 ... hf_ft_job.py --root DIR --max-steps 24
        [--fault KIND:RANK:STEP:CYCLE]...   (KIND: a SimulatedFault type, or sigterm)

A tiny GPT-2 built from a config, token data generated here with a fixed seed, and the
Trainer's habits on: evaluation and saves every few steps, save_total_limit, the best model
loaded at the end, gradient accumulation, DataLoader workers, report_to="none". A run resumes
from the last checkpoint in DIR/out, as a requeued job does. At the end every rank writes
DIR/result.rank<R>.json (global step, weights hash, restart cycle); each rank also writes the
pids of the DataLoader workers it saw to DIR/loaders.rank<R>.cycle<C>.json.
"""

import argparse
import hashlib
import json
import os
import signal
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from nvrx_core.ft.faults import FaultInjector, SimulatedFault
from nvrx_core.ft.process_groups import descendants
from nvrx_hf import NVRxFaultTolerance

CYCLE = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def started(pid):
    """The process's start time (clock ticks since boot): with the pid, it names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except OSError:
        return None


def parse_fault(text):
    kind, rank, step, cycle = text.split(":")
    return kind, int(rank), int(step), int(cycle)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class ExtraFaults(TrainerCallback):
    """Faults of later cycles (and SIGTERM, which is not a SimulatedFault), fired at a step's end
    before NVRxFaultTolerance sees it, as its own; the DataLoader workers recorded meanwhile."""

    def __init__(self, root, faults):
        self.root, self.faults, self.injectors = root, faults, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.injectors = [FaultInjector(SimulatedFault(kind, rank_to_fail=rank, at_iteration=step, cycle=cycle),
                                        rank=args.process_index, world_size=args.world_size)
                          for kind, rank, step, cycle in self.faults if kind != "sigterm"]

    def on_step_end(self, args, state, control, **kwargs):
        # written aside and renamed: the launcher may kill this rank mid-write (another rank's
        # fault), and the test must never read a half-written list
        path = os.path.join(self.root, f"loaders.rank{args.process_index}.cycle{CYCLE}.json")
        with open(path + ".tmp", "w") as f:
            json.dump([[pid, started(pid)] for pid in sorted(descendants(os.getpid()))], f)
        os.replace(path + ".tmp", path)
        for kind, rank, step, cycle in self.faults:
            if kind == "sigterm" and (rank, step, cycle) == (args.process_index, state.global_step, CYCLE):
                os.kill(os.getpid(), signal.SIGTERM)
        for injector in self.injectors:
            injector.maybe_inject(state.global_step)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--max-steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4, help="evaluate and save every N steps")
    parser.add_argument("--fault", action="append", default=[])
    args = parser.parse_args()
    faults = [parse_fault(f) for f in args.fault]

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    out = os.path.join(args.root, "out")
    training = TrainingArguments(
        output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, eval_strategy="steps", eval_steps=args.every, save_strategy="steps",
        save_steps=args.every, save_total_limit=2, load_best_model_at_end=True, logging_steps=args.every,
        dataloader_num_workers=2, report_to="none", use_cpu=True, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(512, seed=1), eval_dataset=Tokens(16, seed=2),
                      callbacks=[ExtraFaults(args.root, faults), NVRxFaultTolerance()])
    trainer.train(resume_from_checkpoint=get_last_checkpoint(out) if os.path.isdir(out) else None)
    weights = b"".join(t.detach().numpy().tobytes() for t in trainer.model.state_dict().values())
    rank = training.process_index
    with open(os.path.join(args.root, f"result.rank{rank}.json"), "w") as f:
        json.dump({"global_step": trainer.state.global_step, "weights": hashlib.sha256(weights).hexdigest(),
                   "cycle": CYCLE}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
