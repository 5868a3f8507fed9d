"""Benchmark: what the rerun state machine costs per training step, and its determinism stats.

nvidia-resiliency-ext 0.4.1 has no rerun state machine, so the "peer" of validate_results
is the same loop with the machine disabled (and the peer of disabled is no machine at
all); --peer-python is accepted and ignored. Modes are timed in interleaved rounds on the
same toy model (medians), in CPU time of this (single-threaded) process: the machine this
runs on is shared, and wall time would mostly measure the neighbours.

    .venv/bin/python bench/rerun.py [--rounds 7] [--steps 25]
"""

import argparse
import logging
import random
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from nvrx_core.events import EventLog
from nvrx_core.rerun import DeviceIdentity, RerunConfig, RerunDataIterator, RerunStateMachine

MICROBATCHES = 2
BATCH, FEATURES, HIDDEN, CLASSES = 64, 256, 1024, 10


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES),
    )


def microbatches():
    generator = torch.Generator().manual_seed(1)
    while True:
        x = torch.randn(BATCH, FEATURES, generator=generator)
        yield x, (x[:, :CLASSES] > 0).long().argmax(dim=1)


class Trainer:
    """A Megatron-style train step; `machine=None` is the loop without any rerun machinery."""

    def __init__(self, reduction_noise: bool = False):
        self.model = make_model()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.machine: Optional[RerunStateMachine] = None
        self.data = microbatches()
        # Summing per-sample losses in an order no RNG restore undoes models a nondeterministic
        # reduction (e.g. GPU atomics): reruns then differ in the last bits.
        self.order = torch.Generator().manual_seed(2) if reduction_noise else None

    def forward_backward(self) -> torch.Tensor:
        self.optimizer.zero_grad()
        total = torch.zeros(())
        for _ in range(MICROBATCHES):
            x, y = next(self.data)
            per_sample = torch.nn.functional.cross_entropy(self.model(x), y, reduction="none")
            if self.order is not None:
                per_sample = per_sample[torch.randperm(BATCH, generator=self.order)]
            loss = per_sample.sum() / (BATCH * MICROBATCHES)
            loss.backward()
            total = total + loss.detach()
        return total

    def step(self) -> None:
        if self.machine is None:
            self.forward_backward()
            self.optimizer.step()
            return
        while self.machine.should_run_forward_backward(self.data):
            self.machine.validate_loss(self.forward_backward())
        should_checkpoint, should_exit, code = self.machine.should_checkpoint_and_exit()
        if should_exit:
            raise SystemExit(f"unexpected exit request {int(code)} in the benchmark")
        self.optimizer.step()


def machine_for(**config) -> RerunStateMachine:
    return RerunStateMachine(RerunConfig(**config), device_identity=DeviceIdentity("bench", "cpu:0"),
                             events=EventLog(None))


MODES: Dict[str, Callable[[], Optional[RerunStateMachine]]] = {
    "no_machine": lambda: None,
    "disabled": lambda: machine_for(rerun_mode="disabled"),
    "validate": lambda: machine_for(rerun_mode="validate_results"),
    "validate_spiky": lambda: machine_for(rerun_mode="validate_results", check_for_spiky_loss=True),
    "determinism": lambda: machine_for(rerun_mode="report_determinism_stats", determinism_stats_interval=0),
}


def time_modes(rounds: int, seed: int = 0) -> Dict[str, List[float]]:
    """CPU ms of single steps, the modes taking turns in a shuffled order every round.

    One model and optimizer serve every mode (same memory, same caches); each mode has its
    own machine and data iterator. Step-by-step turns make load drift hit all modes alike.
    """
    trainer = Trainer()
    machines = {mode: make() for mode, make in MODES.items()}
    iterators = {mode: RerunDataIterator(microbatches()) if m else microbatches() for mode, m in machines.items()}
    times: Dict[str, List[float]] = {mode: [] for mode in MODES}
    order = list(MODES)
    shuffle = random.Random(seed)
    for round_index in range(rounds + 1):
        shuffle.shuffle(order)
        for mode in order:
            trainer.machine, trainer.data = machines[mode], iterators[mode]
            start = time.process_time()
            trainer.step()
            if round_index:  # round 0 warms every mode up
                times[mode].append((time.process_time() - start) * 1e3)
    return times


def machinery_in_loop_us(steps: int = 100) -> float:
    """CPU time of the machine's own calls inside real validate_results steps (median, microseconds).

    This is the overhead the end-to-end ratio tries to see through the noise: snapshot, replay
    buffer, NaN check, vote, each paid with caches the step's matmuls just flushed.
    """
    trainer = Trainer()
    machine = machine_for(rerun_mode="validate_results")
    trainer.machine, trainer.data = machine, RerunDataIterator(microbatches())
    spent = []
    for _ in range(steps + 1):
        start = time.process_time()
        go = machine.should_run_forward_backward(trainer.data)
        inside = time.process_time() - start
        while go:
            loss = trainer.forward_backward()
            start = time.process_time()
            machine.validate_loss(loss)
            go = machine.should_run_forward_backward(trainer.data)
            machine.should_checkpoint_and_exit()
            inside += time.process_time() - start
        trainer.optimizer.step()
        spent.append(inside * 1e6)
    return statistics.median(spent[1:])


def print_ratio(name: str, ours: float, ours_label: str, peer: float, peer_label: str) -> None:
    print(f"{name}: {ours_label} {ours:.3f} ms/step, {peer_label} {peer:.3f} ms/step, ratio {ours / peer:.4f}")


def determinism_report(reduction_noise: bool, steps: int) -> dict:
    trainer = Trainer(reduction_noise)
    trainer.machine = machine_for(rerun_mode="report_determinism_stats", determinism_stats_interval=0)
    trainer.data = RerunDataIterator(microbatches())
    for _ in range(steps):
        trainer.step()
    return trainer.machine.report_determinism_stats()["calls"]["NaN/Inf loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", help="ignored: nvidia-resiliency-ext has no rerun state machine")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=100, help="steps timed per mode and run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)  # steadier timings on a shared machine

    runs = [time_modes(args.rounds, seed) for seed in range(args.runs)]
    per_run = [{mode: statistics.median(values) for mode, values in times.items()} for times in runs]
    median = {mode: statistics.median(v for times in runs for v in times[mode]) for mode in MODES}
    print(f"# toy model: MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, {MICROBATCHES} microbatches of {BATCH}, Adam, "
          f"CPU 1 thread; CPU time per step: median of {args.runs} runs x {args.rounds} steps per mode, "
          "the modes taking turns step by step")
    ratios = ", ".join(f"{run['validate'] / run['disabled']:.4f}" for run in per_run)
    print(f"# validate/disabled ratio of each run's medians (the spread is noise): {ratios}")
    print("# peer: nvidia-resiliency-ext 0.4.1 has no rerun state machine; peer = the same loop with it disabled")
    print_ratio("rerun_validate_overhead", median["validate"], "ours", median["disabled"], "peer(disabled)")
    print_ratio("rerun_validate_spiky_overhead", median["validate_spiky"], "ours", median["disabled"], "peer(disabled)")
    print_ratio("rerun_disabled_overhead", median["disabled"], "ours(disabled)", median["no_machine"], "peer(no machine)")
    print_ratio("rerun_determinism_stats_cost", median["determinism"], "ours", median["disabled"], "peer(disabled)")
    inside = machinery_in_loop_us()
    print(f"rerun_validate_machinery_in_step: ours {inside:.0f} us/step = {inside / 10 / median['disabled']:.2f}% "
          f"of a {median['disabled']:.1f} ms step (the machine's own calls, timed inside the loop)")

    for label, noise in (("deterministic", False), ("nondeterministic_reduction", True)):
        s = determinism_report(noise, steps=20)
        print(f"rerun_determinism_stats[{label}]: loss relative difference over {s['count']} steps: "
              f"p50 {s['p50']:.3g}, p90 {s['p90']:.3g}, p99 {s['p99']:.3g}, max {s['max']:.3g}")


if __name__ == "__main__":
    main()
