"""A Hugging Face Trainer run with nvrx_hf's fault tolerance (CPU, gloo; runs as is on GPUs).

    ft_launcher --nproc-per-node 2 --max-restarts 3 \
        --warm-start-preload transformers.trainer,nvrx_hf \
        examples/hf_ft.py --output-dir /tmp/hf_ft

A tiny GPT-2 built from a config and token data generated here: nothing is downloaded. Kill a
rank (`pkill -9 -f hf_ft.py` hits one at random) or stop one with SIGSTOP: ft_launcher restarts
the job and the Trainer resumes from its last checkpoint. SIGTERM to one rank stops every rank
at the same step; the Trainer saves and the job exits 18, and the next run resumes from that
checkpoint. Under plain `python` or torchrun it trains too; fault tolerance then says once that
it is inactive.
"""

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from nvrx_hf import NVRxFaultTolerance, NVRxPreemption


class RandomTokens(torch.utils.data.Dataset):
    """Token sequences from a fixed seed: every run (and every restart) sees the same data."""

    def __init__(self, n: int, seed: int):
        self.ids = torch.randint(0, 256, (n, 32), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=200)
    args = parser.parse_args()

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=32))
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=2, learning_rate=3e-4, eval_strategy="steps", eval_steps=20,
        save_strategy="steps", save_steps=20, save_total_limit=2, load_best_model_at_end=True,
        logging_steps=20, dataloader_num_workers=2, report_to="none", seed=0)
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(4096, seed=1),
                      eval_dataset=RandomTokens(64, seed=2),
                      callbacks=[NVRxFaultTolerance(), NVRxPreemption(check_every_n_steps=5)])
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
