"""Pretrain a tiny GPT with the reference Bridge-style trainer (bridge_style.py).

    ft_launcher --nproc-per-node 2 --max-restarts 3 \\
        --ft-rank-section-timeouts setup:600,step:60,checkpointing:120 --ft-rank-out-of-section-timeout 60 \\
        examples/megatron_style/pretrain_gpt.py --save /tmp/gpt --train-iters 200 --enable-ft

Flags switch on each config the way a Bridge recipe sets `cfg.ft`, `cfg.nvrx_straggler`,
`cfg.inprocess_restart` and `cfg.rerun_state_machine`. Every batch is a function of
(iteration, rank), so a job resumed from any checkpoint computes what an uninterrupted one
does; --weights-file writes a hash of the final weights (rank 0).
"""

import argparse
import hashlib
import logging
import os
import sys

import torch

from bridge_style import CheckpointConfig, ConfigContainer, TrainConfig, pretrain
from nvrx_megatron import (FaultToleranceConfig, InProcessRestartConfig, NVRxStragglerDetectionConfig,
                           RerunStateMachineConfig)

VOCAB, SEQ, WIDTH = 64, 16, 32


class TinyGPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.block = torch.nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=64, batch_first=True,
                                                      dropout=0.0)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens), src_mask=self.causal, is_causal=True))


class Batches:
    """Deterministic token batches: batch i of rank r is the same in every run."""

    def __init__(self, start: int, micro_batch_size: int, nan_at: int = -1):
        self.iteration, self.size, self.nan_at = start, micro_batch_size, nan_at
        self.rank = int(os.environ.get("RANK", 0))

    def __iter__(self):
        return self

    def __next__(self):
        gen = torch.Generator().manual_seed(self.iteration * 1000 + self.rank)
        self.iteration += 1
        return torch.randint(0, VOCAB, (self.size, SEQ + 1), generator=gen), self.iteration == self.nan_at


def forward_step(data_iterator, model):
    """Megatron's shape: returns the output and a function turning it into the loss."""
    tokens, poisoned = next(data_iterator)
    logits = model(tokens[:, :-1])

    def loss_func(output):
        loss = torch.nn.functional.cross_entropy(output.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        return loss * float("nan") if poisoned else loss
    return logits, loss_func


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--save", required=True)
    p.add_argument("--train-iters", type=int, default=100)
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--enable-ft", action="store_true")
    p.add_argument("--calc-ft-timeouts", action="store_true")
    p.add_argument("--simulated-fault", default=None, help="rank_killed:RANK:DELAY_S or rank_hung:RANK:DELAY_S")
    p.add_argument("--straggler", action="store_true")
    p.add_argument("--inprocess", action="store_true")
    p.add_argument("--rerun-mode", default="disabled", choices=("disabled", "validate_results", "report_determinism_stats"))
    p.add_argument("--nan-at", type=int, default=-1, help="poison the loss of this iteration (rank 0's batch)")
    p.add_argument("--exit-signal-handler", action="store_true")
    p.add_argument("--weights-file", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    ft = FaultToleranceConfig(enable_ft_package=args.enable_ft, calc_ft_timeouts=args.calc_ft_timeouts)
    if args.simulated_fault:
        kind, rank, delay = args.simulated_fault.split(":")
        ft = FaultToleranceConfig(enable_ft_package=True, calc_ft_timeouts=args.calc_ft_timeouts, simulate_fault=True,
                                  simulated_fault_type=kind, simulated_fault_rank=int(rank),
                                  simulated_fault_base_delay=int(delay))
    cfg = ConfigContainer(
        train=TrainConfig(train_iters=args.train_iters, exit_signal_handler=args.exit_signal_handler),
        checkpoint=CheckpointConfig(save=args.save, save_interval=args.save_interval),
        ft=ft,
        nvrx_straggler=NVRxStragglerDetectionConfig(enabled=True, report_time_interval=2.0) if args.straggler else None,
        inprocess_restart=InProcessRestartConfig(enabled=True) if args.inprocess else None,
        rerun_state_machine=RerunStateMachineConfig(rerun_mode=args.rerun_mode),
    )
    nan_at = args.nan_at if int(os.environ.get("RANK", 0)) == 0 else -1
    model = None

    def model_provider():
        nonlocal model
        model = TinyGPT()
        return model
    code = pretrain(cfg, forward_step, model_provider, lambda start: Batches(start, 8, nan_at))
    if args.weights_file and int(os.environ.get("RANK", 0)) == 0 and code == 0:
        weights = b"".join(t.detach().cpu().numpy().tobytes() for t in model.state_dict().values())
        with open(args.weights_file, "w") as f:
            f.write(hashlib.sha256(weights).hexdigest())
    return code


if __name__ == "__main__":
    sys.exit(main())
