"""The tiny Hugging Face Trainer job shared by tests/scripts/hf_preempt_job.py and
hf_straggler_job.py: a one-layer GPT-2 built from a config (nothing downloaded), token data
generated from a fixed seed, CPU, no reporting integrations.

Deterministic by construction, so a run resumed from a checkpoint can be compared with an
uninterrupted one weight for weight: dropout is off, the model's initial weights and the data
come from fixed seeds, and the Trainer's own seeded sampler, checkpointed optimizer, scheduler
and RNG states do the rest.
"""

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it (a launcher sets it too)
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

from nvrx_core.durable import atomic_write_json  # noqa: E402

SEQ = 16
VOCAB = 64


class Tokens(Dataset):
    """`n` sequences of random tokens (fixed seed); each is its own language-modelling label."""

    def __init__(self, n: int = 4096, seed: int = 0):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def tiny_model(seed: int = 0) -> GPT2LMHeadModel:
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def training_args(out: str, max_steps: int, **overrides) -> TrainingArguments:
    values = dict(output_dir=out, max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-2,
                  save_strategy="steps", save_steps=100_000, logging_steps=1_000, report_to="none", use_cpu=True,
                  disable_tqdm=True, seed=0, dataloader_num_workers=0, remove_unused_columns=False,
                  ddp_find_unused_parameters=False)
    values.update(overrides)
    return TrainingArguments(**values)


class Progress(TrainerCallback):
    """Publishes this rank's pid and global step after every optimizer step (the test signals
    that pid), then sleeps `pace_s`, which leaves the test a window to signal mid-training."""

    def __init__(self, out: str, rank: int, pace_s: float = 0.0):
        self.path = os.path.join(out, f"progress.rank{rank}")
        self.pace_s = pace_s
        self.start_step = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        atomic_write_json(self.path, {"pid": os.getpid(), "step": state.global_step, "start_step": self.start_step})
        if self.pace_s:
            time.sleep(self.pace_s)


def rank_and_world():
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
