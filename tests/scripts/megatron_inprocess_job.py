"""One rank of a Bridge-style job under nvrx_megatron's in-process restart (tests/test_megatron_inprocess.py).

Shaped like Bridge's pretrain(): maybe_wrap_for_inprocess_restart(_pretrain, cfg, state), then
wrapped(state, forward_step_func, store=store); _pretrain builds its gloo group on
PrefixStore(str(inprocess_call_wrapper.iteration), store) and destroys it at the end.

argv[1]: JSON {"outdir", "config" (InProcessRestartConfig fields), "steps", "fault_rank",
"fault_step", "fault_iterations" (list or "all")}. Writes rank<N>.json: pid per call, the
timeline (monotonic seconds: CLOCK_MONOTONIC is one clock for every process of the machine),
reset_for_restart calls, the final value, and how the rank ended.
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from nvrx_megatron import InProcessRestartConfig
from nvrx_megatron.inprocess_restart import maybe_wrap_for_inprocess_restart

params = json.loads(sys.argv[1])
RANK = int(os.environ["RANK"])
snapshot = {"step": 0, "value": torch.zeros(4)}  # lives across restarts, as the process does
record = {"rank": RANK, "calls": [], "timeline": [], "resets": 0, "ended": None}


class TrainState:
    step = 0


class GlobalState:
    """Duck-typed like Bridge's GlobalState: what the adapter touches between iterations."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.train_state = TrainState()
        self.async_calls_queue = None

    def reset_for_restart(self):
        record["resets"] += 1
        self.train_state = TrainState()


def forward_step_func(step, value):
    """One training step: a collective every rank must join (a fault elsewhere breaks it)."""
    contribution = torch.full((4,), float(step + 1)) * (RANK + 1)
    dist.all_reduce(contribution)
    return value + contribution


def _pretrain(state, forward_step_func, store=None, inprocess_call_wrapper=None):
    if inprocess_call_wrapper is not None:  # Bridge's _pretrain, word for word in behaviour
        store = dist.PrefixStore(str(inprocess_call_wrapper.iteration), store)
    iteration = inprocess_call_wrapper.iteration
    record["calls"].append({"iteration": iteration, "pid": os.getpid(), "rank": int(os.environ["RANK"]),
                            "world_size": int(os.environ["WORLD_SIZE"])})
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=datetime.timedelta(seconds=20))
    step, value = snapshot["step"], snapshot["value"].clone()
    while step < params["steps"]:
        faulty = iteration in params["fault_iterations"] if params["fault_iterations"] != "all" else True
        if RANK == params["fault_rank"] and step == params["fault_step"] and faulty:
            record["timeline"].append(["fault", time.monotonic(), iteration, step])
            raise ValueError(f"injected fault at step {step}")
        value = forward_step_func(step, value)
        step += 1
        state.train_state.step = step
        snapshot.update(step=step, value=value.clone())
        record["timeline"].append(["step", time.monotonic(), iteration, step])
    dist.barrier()
    dist.destroy_process_group()
    return value.tolist()


def main():
    cfg = InProcessRestartConfig(**params["config"])
    state = GlobalState(cfg)
    wrapped, store = maybe_wrap_for_inprocess_restart(_pretrain, cfg, state)
    try:
        record["value"] = wrapped(state, forward_step_func, store=store)
        record["ended"] = "returned"
    except SystemExit as e:
        record["ended"] = f"exit {e.code}"
        raise
    finally:
        path = os.path.join(params["outdir"], f"rank{RANK}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
