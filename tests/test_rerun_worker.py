"""A Megatron-style toy training loop driven by the rerun state machine, run as a real process.

The protocol tests start it with `python tests/test_rerun_worker.py ...` (one process per
rank, gloo for two ranks), let it exit with the machine's exit code, resume it from its
checkpoint in a new process, and read the JSON it leaves behind. Its own tests (below)
check the property the protocol rests on: a rerun from the saved RNG state and replayed
microbatches reproduces the first run bit for bit on CPU.

Injection at one chosen step uses a RerunErrorInjector subclass so a test knows where the
protocol starts; the config-driven injector is covered by test_rerun_machine.py.
"""

import argparse
import itertools
import json
import os
import sys
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist

from nvrx_core.durable import atomic_write_json, atomic_write_with
from nvrx_core.events import EventLog
from nvrx_core.rerun import (
    DeviceIdentity, RerunConfig, RerunDataIterator, RerunDiagnostic, RerunErrorInjector, RerunStateMachine,
)

MICROBATCHES = 2
BATCH, FEATURES = 8, 16


class InjectAtStep(RerunErrorInjector):
    """Injects `kind` at the first validation of the steps it is armed for."""

    def __init__(self, kind: RerunDiagnostic):
        super().__init__(rate=1, kind=kind)
        self.armed = False

    def draw(self) -> Optional[RerunDiagnostic]:
        return self.kind if self.armed else None


def microbatches(seed: int, nan_at: int = 0, spike_at: int = 0) -> Iterator[dict]:
    """An endless, reproducible stream; step s (1-based) gets microbatches 2(s-1) and 2(s-1)+1."""
    generator = torch.Generator().manual_seed(seed)
    for index in itertools.count():
        step = index // MICROBATCHES + 1
        x = torch.randn(BATCH, FEATURES, generator=generator)
        y = x[:, :4].sum(dim=1, keepdim=True) * 0.5
        if step == nan_at and index % MICROBATCHES == 0:
            x[0, 0] = float("nan")
        if step == spike_at:
            y = y * 1000.0
        yield {"x": x, "y": y}


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="run")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--mode", default="validate_results")
    p.add_argument("--identity", default="node-a/cpu:0,node-a/cpu:1",
                   help="host/device each rank claims to run on, comma-separated by rank")
    p.add_argument("--nan-at-step", type=int, default=0)
    p.add_argument("--spike-at-step", type=int, default=0)
    p.add_argument("--spiky", action="store_true")
    p.add_argument("--inject-at-step", type=int, default=0)
    p.add_argument("--inject-type", default="transient_error")
    p.add_argument("--inject-rank", type=int, default=-1, help="-1: every rank")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--abandon", action="store_true")
    p.add_argument("--max-same-device-restarts", type=int, default=2)
    p.add_argument("--noise-rank", type=int, default=-1, help="this rank adds noise no RNG restore undoes")
    p.add_argument("--stats-interval", type=int, default=0)
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(args)
    finally:
        torch.set_num_threads(threads)


def _train(args: argparse.Namespace) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    host, device = args.identity.split(",")[rank].split("/")
    config = RerunConfig(
        rerun_mode=args.mode, check_for_spiky_loss=args.spiky, spiky_loss_warmup=2, spiky_loss_min_samples=2,
        error_injection_type=args.inject_type, max_same_device_restarts=args.max_same_device_restarts,
        result_rejected_tracker_filename=os.path.join(args.out, "rejected.jsonl"),
        determinism_stats_interval=args.stats_interval,
    )
    injector = InjectAtStep(config.error_injection_type)
    machine = RerunStateMachine(
        config, device_identity=DeviceIdentity(host, device), injector=injector,
        events=EventLog(os.path.join(args.out, "events.jsonl"), rank=rank, node=host, source="rerun"),
    )
    model = make_model(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    checkpoint_path = os.path.join(args.out, f"ckpt-rank{rank}.pt")
    completed, drawn = 0, 0
    if args.resume:
        checkpoint = torch.load(checkpoint_path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        machine.load_state_dict(checkpoint["rerun"], abandon_pending_rerun=args.abandon)
        completed = checkpoint["completed_steps"]
        drawn = checkpoint["rerun"]["data_iterators"][0]["drawn"]
    stream = microbatches(seed=100 + rank, nan_at=args.nan_at_step, spike_at=args.spike_at_step)
    data = RerunDataIterator(itertools.islice(stream, drawn, None))
    noise = torch.Generator().manual_seed(7)
    result = {"rank": rank, "runs": {}, "iterations": {}, "losses": {}, "resumed_at": completed + 1}
    exit_code = 0
    for step in range(completed + 1, args.steps + 1):
        injector.armed = step == args.inject_at_step and args.inject_rank in (-1, rank)
        runs = 0
        while machine.should_run_forward_backward(data):
            runs += 1
            optimizer.zero_grad()
            total = torch.zeros(())
            for _ in range(MICROBATCHES):
                batch = next(data)
                output = model(batch["x"])
                if rank == args.noise_rank:
                    output = output + 1e-4 * torch.randn(output.shape, generator=noise)
                loss = torch.nn.functional.mse_loss(output, batch["y"]) / MICROBATCHES
                loss.backward()
                total = total + loss.detach()
            if world > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            machine.validate_loss(total)
        should_checkpoint, should_exit, code = machine.should_checkpoint_and_exit()
        result["runs"][step] = runs
        result["iterations"][step] = machine.current_iteration
        if should_checkpoint:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "completed_steps": step - 1, "rerun": machine.state_dict(data)}
            atomic_write_with(checkpoint_path, lambda f: torch.save(state, f))
        if should_exit:
            exit_code = int(code)
            break
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        result["losses"][step] = total.item()
    result["exit_code"] = exit_code
    result["diagnoses"] = [d.diagnosis for d in machine.diagnoses]
    result["param_sum"] = float(sum(p.detach().double().sum() for p in model.parameters()))
    result["stats"] = machine.last_determinism_report
    atomic_write_json(os.path.join(args.out, f"result-{args.tag}-rank{rank}.json"), result)
    if world > 1:
        dist.destroy_process_group()
    return exit_code


# ------------------------------------------------------------------- its tests
def test_two_identical_runs_give_identical_losses(tmp_path):
    """The protocol compares reruns with tolerance 0: the toy loop must be deterministic."""
    for tag in ("a", "b"):
        assert train(parse_args(["--out", str(tmp_path), "--tag", tag, "--steps", "4", "--mode", "disabled"])) == 0
    a, b = (json.loads((tmp_path / f"result-{t}-rank0.json").read_text()) for t in ("a", "b"))
    assert a["losses"] == b["losses"] and len(a["losses"]) == 4
    assert a["param_sum"] == b["param_sum"]


def test_rerun_in_place_reproduces_bitwise_despite_dropout(tmp_path):
    """Determinism stats rerun every step: with RNG restored and batches replayed, differences are 0."""
    args = ["--out", str(tmp_path), "--steps", "4", "--mode", "report_determinism_stats", "--stats-interval", "4"]
    assert train(parse_args(args)) == 0
    stats = json.loads((tmp_path / "result-run-rank0.json").read_text())["stats"]
    assert stats["calls"]["NaN/Inf loss"]["count"] == 4
    assert stats["calls"]["NaN/Inf loss"]["max"] == 0.0
    # A noise source no RNG restore undoes shows up in the same statistics.
    assert train(parse_args(args + ["--tag", "noisy", "--noise-rank", "0"])) == 0
    noisy = json.loads((tmp_path / "result-noisy-rank0.json").read_text())["stats"]
    assert noisy["calls"]["NaN/Inf loss"]["max"] > 0.0


if __name__ == "__main__":
    sys.exit(train(parse_args()))
