"""Pretrain a tiny GPT with the reference Bridge-style trainer (bridge_style.py).

    ft_launcher --nproc-per-node 2 --max-restarts 3 \\
        --ft-rank-section-timeouts setup:600,step:60,checkpointing:120 --ft-rank-out-of-section-timeout 60 \\
        examples/megatron_style/pretrain_gpt.py --save /tmp/gpt --train-iters 200 --enable-ft

Flags switch on each config the way a Bridge recipe sets `cfg.ft`, `cfg.nvrx_straggler`,
`cfg.inprocess_restart` and `cfg.rerun_state_machine`. Every batch is a function of
(iteration, rank), so a job resumed from any checkpoint computes what an uninterrupted one
does; --result-dir gets how each rank's run ended (exit code, iteration, a hash of the
final weights, the straggler verdict).
"""

import argparse
import dataclasses
import functools
import hashlib
import logging
import os
import signal
import sys
import time
from typing import List, Optional, Type

import torch
import yaml

from nvrx_core.durable import atomic_write_json
from nvrx_megatron import (FaultToleranceConfig, InProcessRestartConfig, NVRxStragglerDetectionConfig,
                           RerunStateMachineConfig)

from bridge_style import CheckpointConfig, ConfigContainer, GlobalState, TrainConfig, pretrain

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
    """Deterministic token batches: batch i of rank r is the same in every run. Yields
    (tokens, iteration), so the loss can be poisoned at a chosen iteration."""

    def __init__(self, start: int, micro_batch_size: int):
        self.iteration, self.size = start, micro_batch_size
        self.rank = int(os.environ.get("RANK", 0))

    def __iter__(self):
        return self

    def __next__(self):
        gen = torch.Generator().manual_seed(self.iteration * 1000 + self.rank)
        self.iteration += 1
        return torch.randint(0, VOCAB, (self.size, SEQ + 1), generator=gen), self.iteration


class LossFaults:
    """What this rank does to its steps, to rehearse the resiliency parts: a NaN loss that comes
    with the data (every computation of that iteration), a NaN or a spike that only the first
    computation gets (a transient fault), an exception once (in-process restart), a longer
    step (a slow rank). The object outlives an in-process restart, so a one-off stays one-off."""

    def __init__(self, nan_at=-1, transient_nan_at=-1, spike_at=-1, raise_at=-1, step_time=0.0, slowdown=1.0,
                 kill_at=-1, kill_marker=None):
        self.nan_at, self.transient_nan_at, self.spike_at = nan_at, transient_nan_at, spike_at
        self.raise_at, self.step_time, self.slowdown = raise_at, step_time, slowdown
        self.kill_at, self.kill_marker = kill_at, kill_marker
        self._struck = set()

    def maybe_raise(self, iteration: int) -> None:
        if iteration == self.raise_at and "raise" not in self._struck:
            self._struck.add("raise")
            raise RuntimeError(f"injected exception at iteration {iteration}")
        if iteration == self.kill_at and self.kill_marker and not os.path.exists(self.kill_marker):
            os.makedirs(os.path.dirname(self.kill_marker), exist_ok=True)
            open(self.kill_marker, "w").close()  # once per run: a replacement process must not strike again
            os.kill(os.getpid(), signal.SIGKILL)

    def loss(self, loss: torch.Tensor, iteration: int) -> torch.Tensor:
        if iteration == self.nan_at:
            return loss * float("nan")
        if iteration in (self.transient_nan_at, self.spike_at) and iteration not in self._struck:
            self._struck.add(iteration)
            return loss * (float("nan") if iteration == self.transient_nan_at else 1000.0)
        return loss

    def spend(self, started: float) -> None:
        """Make the forward take step_time, times slowdown (its own compute included)."""
        busy = time.perf_counter() - started
        time.sleep(max(0.0, max(self.step_time, busy) * self.slowdown - busy))


def forward_step(data_iterator, model, faults: LossFaults):
    """Megatron's shape: returns the output and a function turning it into the loss."""
    started = time.perf_counter()
    tokens, iteration = next(data_iterator)
    faults.maybe_raise(iteration)
    tokens = tokens.to(next(model.parameters()).device)
    logits = model(tokens[:, :-1])
    faults.spend(started)

    def loss_func(output):
        loss = torch.nn.functional.cross_entropy(output.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        return faults.loss(loss, iteration)
    return logits, loss_func


def _on_rank(spec: str, cast=int):
    """'RANK:VALUE' -> VALUE on that rank, else None."""
    if not spec:
        return None
    rank, value = spec.split(":")
    return cast(value) if int(rank) == int(os.environ.get("RANK", 0)) else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save", required=True)
    p.add_argument("--train-iters", type=int, default=100)
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--enable-ft", action="store_true")
    p.add_argument("--calc-ft-timeouts", action="store_true")
    p.add_argument("--simulated-fault", default=None, metavar="KIND:RANK:DELAY_S",
                   help="Bridge's simulated fault (rank_killed, rank_hung, random); it fires in the first cycle only")
    p.add_argument("--straggler", action="store_true")
    p.add_argument("--straggler-stop-threshold", type=float, default=None, metavar="SCORE",
                   help="stop (exit 19, after a checkpoint) when a rank's relative score drops below SCORE")
    p.add_argument("--inprocess", action="store_true")
    p.add_argument("--rerun-mode", default="disabled",
                   choices=("disabled", "validate_results", "report_determinism_stats"))
    p.add_argument("--check-for-spiky-loss", action="store_true")
    p.add_argument("--nan-at", default="", metavar="RANK:ITER", help="a NaN loss that comes with the data")
    p.add_argument("--transient-nan-at", default="", metavar="RANK:ITER", help="a NaN loss once (not on a rerun)")
    p.add_argument("--spike-at", default="", metavar="RANK:ITER", help="a loss 1000x too large once")
    p.add_argument("--raise-at", default="", metavar="RANK:ITER", help="an exception in that forward, once")
    p.add_argument("--kill-at", default="", metavar="RANK:ITER", help="SIGKILL that rank in that forward, once")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds each forward takes at least")
    p.add_argument("--slow-rank", default="", metavar="RANK:FACTOR", help="that rank's forward takes FACTOR times longer")
    p.add_argument("--exit-signal-handler", action="store_true")
    p.add_argument("--result-dir", default=None, help="where each rank writes result<RANK>.json: how its run ended")
    p.add_argument("overrides", nargs="*", metavar="SECTION.FIELD=VALUE",
                   help="Bridge-style config overrides, e.g. ft.calc_ft_timeouts=true")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> ConfigContainer:
    """The ConfigContainer a Bridge recipe would set up for these flags."""
    ft = FaultToleranceConfig(enable_ft_package=args.enable_ft, calc_ft_timeouts=args.calc_ft_timeouts)
    if args.simulated_fault:
        kind, rank, delay = args.simulated_fault.split(":")
        ft = FaultToleranceConfig(enable_ft_package=True, calc_ft_timeouts=args.calc_ft_timeouts, simulate_fault=True,
                                  simulated_fault_type=kind, simulated_fault_rank=int(rank),
                                  simulated_fault_base_delay=int(delay))
    straggler = None
    if args.straggler:
        straggler = NVRxStragglerDetectionConfig(enabled=True, report_time_interval=2.0)
        if args.straggler_stop_threshold is not None:
            straggler = NVRxStragglerDetectionConfig(
                enabled=True, report_time_interval=1.0, stop_if_detected=True,
                gpu_relative_perf_threshold=args.straggler_stop_threshold,
                gpu_individual_perf_threshold=args.straggler_stop_threshold)
    return ConfigContainer(
        train=TrainConfig(train_iters=args.train_iters, exit_signal_handler=args.exit_signal_handler),
        checkpoint=CheckpointConfig(save=args.save, save_interval=args.save_interval),
        ft=ft,
        nvrx_straggler=straggler,
        inprocess_restart=InProcessRestartConfig(enabled=True) if args.inprocess else None,
        rerun_state_machine=RerunStateMachineConfig(rerun_mode=args.rerun_mode,
                                                    check_for_spiky_loss=args.check_for_spiky_loss),
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = apply_overrides(build_config(args), args.overrides)
    return train_tiny_gpt(cfg, loss_faults(args), args.result_dir)


def loss_faults(args: argparse.Namespace, kind: Type[LossFaults] = LossFaults) -> LossFaults:
    """What the fault flags ask of this rank, as a `kind` (LossFaults or a subclass)."""
    return kind(nan_at=_on_rank(args.nan_at) or -1, transient_nan_at=_on_rank(args.transient_nan_at) or -1,
                spike_at=_on_rank(args.spike_at) or -1, raise_at=_on_rank(args.raise_at) or -1,
                step_time=args.step_time, slowdown=_on_rank(args.slow_rank, float) or 1.0,
                kill_at=_on_rank(args.kill_at) or -1, kill_marker=os.path.join(args.save, "killed"))


def train_tiny_gpt(cfg: ConfigContainer, faults: Optional[LossFaults] = None, result_dir: Optional[str] = None,
                   state: Optional[GlobalState] = None) -> int:
    """Pretrain the tiny GPT with `cfg`; the exit code (0, or a stop's code). `state`: the
    GlobalState to run on, e.g. one holding a straggler manager of your own (bridge_style.pretrain)."""
    faults = faults or LossFaults()
    models = []

    def model_provider():
        models.append(TinyGPT())
        return models[-1]
    state = state if state is not None else GlobalState(cfg)
    code = pretrain(cfg, functools.partial(forward_step, faults=faults), model_provider,
                    lambda start: Batches(start, 8), state=state)
    if result_dir:
        write_result(result_dir, state, models[-1])
    return code


def pretrain_tiny_gpt(cfg: ConfigContainer, step_time: float = 0.0, result_dir: Optional[str] = None) -> None:
    """The trainer as a function of its ConfigContainer, for `run.Partial(pretrain_tiny_gpt, cfg=...)`
    (NeMo-Run's plugins set cfg.ft, cfg.nvrx_straggler, ... on it); a stop's code becomes the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    code = train_tiny_gpt(cfg, LossFaults(step_time=step_time), result_dir)
    if code:
        sys.exit(code)


SECTIONS = {"train": TrainConfig, "checkpoint": CheckpointConfig, "ft": FaultToleranceConfig,
            "nvrx_straggler": NVRxStragglerDetectionConfig, "inprocess_restart": InProcessRestartConfig,
            "rerun_state_machine": RerunStateMachineConfig}


def apply_overrides(cfg: ConfigContainer, overrides: List[str]) -> ConfigContainer:
    """Bridge's hydra-style `section.field=value` overrides (what NeMo-Run plugins append to a
    run.Script); a section left None is created with its defaults first."""
    for override in overrides:
        key, sep, text = override.partition("=")
        section, dot, field = key.partition(".")
        if not sep or not dot or section not in SECTIONS:
            raise SystemExit(f"override {override!r}: expected SECTION.FIELD=VALUE with SECTION one of {list(SECTIONS)}")
        current = getattr(cfg, section) or SECTIONS[section]()
        if field not in {f.name for f in dataclasses.fields(current)}:
            raise SystemExit(f"override {override!r}: {type(current).__name__} has no field {field!r}")
        setattr(cfg, section, dataclasses.replace(current, **{field: yaml.safe_load(text)}))  # re-validated
    return cfg


def write_result(directory: str, state: GlobalState, model: torch.nn.Module) -> None:
    """How this rank's run ended: exit code, iteration, restart cycle, weights, straggler verdict
    (the flagged ranks; on rank 0, which scores the report, every rank's relative score)."""
    rank = int(os.environ.get("RANK", 0))
    weights = b"".join(t.detach().cpu().numpy().tobytes() for t in model.state_dict().values())
    report = getattr(state.nvrx_straggler_manager, "last_report", None)
    result = {"rank": rank, "pid": os.getpid(), "exit_code": state.exit_code, "iteration": state.train_state.step,
              "cycle": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
              "weights": hashlib.sha256(weights).hexdigest(),
              "stragglers": sorted(report.flagged_ranks) if report is not None else None,
              "relative_scores": ({str(r): s for r, s in sorted(report.relative.get("overall", {}).items())}
                                  if report is not None else None)}
    os.makedirs(directory, exist_ok=True)
    atomic_write_json(os.path.join(directory, f"result{rank}.json"), result)


if __name__ == "__main__":
    sys.exit(main())
