"""bench/megatron.py's job: a Bridge-style loop (1 rank) with paced steps, timing its FT calls.

    --client ours   nvrx_megatron.fault_tolerance's hooks (Bridge's names) around every step
                    and every 10th-step save
    --client nvrx   nvidia-resiliency-ext 0.4.1's RankMonitorClient making the section calls
                    Bridge's hooks make (setup, step, checkpointing)
    --client none   the same loop without either

Prints `RESULT {"hooks_us": median per iteration of the time spent in FT calls,
"iteration_ms": median iteration time}`.
"""
import argparse
import json
import os
import statistics
import tempfile
import time
from types import SimpleNamespace

p = argparse.ArgumentParser()
p.add_argument("--client", choices=("ours", "nvrx", "none"), required=True)
p.add_argument("--iterations", type=int, default=200)
p.add_argument("--step-time", type=float, default=0.05)
args = p.parse_args()


class PeerHooks:
    """The section calls Bridge's hooks make, on nvidia-resiliency-ext's client."""

    def __init__(self):
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        self.client = RankMonitorClient()
        self.client.init_workload_monitoring()
        self.client.start_section("setup")
        self.setup_open, self.steps = True, 0

    def step_start(self):
        if self.setup_open:
            self.client.end_section("setup")
            self.setup_open = False
        if self.steps >= 1:
            self.client.start_section("step")

    def step_end(self):
        if self.steps >= 1:
            self.client.end_section("step")
        self.steps += 1

    def checkpointing(self, start):
        (self.client.start_section if start else self.client.end_section)("checkpointing")

    def close(self):
        self.client.shutdown_workload_monitoring()


class OurHooks:
    def __init__(self):
        from nvrx_megatron import FaultToleranceConfig, fault_tolerance

        self.ft = fault_tolerance
        cfg = SimpleNamespace(ft=FaultToleranceConfig(enable_ft_package=True),
                              checkpoint=SimpleNamespace(save=tempfile.mkdtemp(), async_save=False),
                              train=SimpleNamespace(train_iters=args.iterations))
        self.state = SimpleNamespace(cfg=cfg, train_state=SimpleNamespace(step=0), rank_monitor_client=None)
        fault_tolerance.setup(cfg, self.state)

    def step_start(self):
        self.ft.on_training_step_start(self.state)

    def step_end(self):
        self.state.train_state.step += 1
        self.ft.on_training_step_end(self.state)

    def checkpointing(self, start):
        if start:
            self.ft.on_checkpointing_start(self.state)
        else:
            self.ft.on_checkpointing_end(False, self.state)

    def close(self):
        self.ft.abort(self.state)      # no timeout learning: not what is timed here


hooks = {"ours": OurHooks, "nvrx": PeerHooks}.get(args.client, lambda: None)()
spent, iterations = [], []
for i in range(1, args.iterations + 1):
    t0 = time.perf_counter()
    in_hooks = 0.0
    if hooks:
        a = time.perf_counter()
        hooks.step_start()
        in_hooks += time.perf_counter() - a
    time.sleep(args.step_time)                              # the step's work
    if hooks:
        a = time.perf_counter()
        hooks.step_end()
        if i % 10 == 0:
            hooks.checkpointing(True)
            hooks.checkpointing(False)
        in_hooks += time.perf_counter() - a
    spent.append(in_hooks)
    iterations.append(time.perf_counter() - t0)
if hooks:
    hooks.close()
print("RESULT " + json.dumps({"hooks_us": statistics.median(spent[5:]) * 1e6,
                              "iteration_ms": statistics.median(iterations[5:]) * 1e3}), flush=True)
