"""A Megatron-Bridge loop's resiliency calls, moved to nvrx-suite by changing the imports only.

    ft_launcher --nproc-per-node 2 --max-restarts 2 \\
        --ft-initial-rank-heartbeat-timeout 60 --ft-rank-heartbeat-timeout 30 \\
        examples/megatron_style/from_bridge.py --raise-at 20

The calls and their order are Bridge's pretrain(): wrap the training function for in-process
restart, open fault tolerance, build the straggler manager and the rerun machine, and call the
step hooks around each step. `--raise-at N` raises in the last rank at step N once: the job
restarts in-process (same processes) and finishes. docs/migrating.md shows the Bridge imports
this replaces.
"""

import argparse
import datetime
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

# Before (Megatron-Bridge / megatron-core):
# from megatron.bridge.training.config import (FaultToleranceConfig, InProcessRestartConfig,
#                                              NVRxStragglerDetectionConfig, RerunStateMachineConfig)
# from megatron.bridge.training import fault_tolerance
# from megatron.bridge.training.inprocess_restart import maybe_wrap_for_inprocess_restart
# from megatron.bridge.training.nvrx_straggler import (NVRxStragglerDetectionManager,
#     check_nvrx_straggler_detection, safe_shutdown_nvrx_straggler_manager)
# from megatron.core.rerun_state_machine import RerunDataIterator, RerunStateMachine
from nvrx_megatron import (FaultToleranceConfig, InProcessRestartConfig, NVRxStragglerDetectionConfig,
                           RerunStateMachineConfig, fault_tolerance)
from nvrx_megatron.inprocess_restart import maybe_wrap_for_inprocess_restart
from nvrx_megatron.nvrx_straggler import (NVRxStragglerDetectionManager, check_nvrx_straggler_detection,
                                          safe_shutdown_nvrx_straggler_manager)
from nvrx_megatron.rerun_state_machine import RerunDataIterator, RerunStateMachine

args = argparse.ArgumentParser()
args.add_argument("--train-iters", type=int, default=60)
args.add_argument("--save", default="/tmp/nvrx_from_bridge")
args.add_argument("--raise-at", type=int, default=None)
args = args.parse_args()

cfg = SimpleNamespace(  # the sections of Bridge's ConfigContainer these calls read
    ft=FaultToleranceConfig(enable_ft_package=True, calc_ft_timeouts=True),
    nvrx_straggler=NVRxStragglerDetectionConfig(enabled=True, report_time_interval=5.0),
    inprocess_restart=InProcessRestartConfig(enabled=True, soft_timeout=30.0, hard_timeout=60.0,
                                             heartbeat_interval=1.0, heartbeat_timeout=20.0, last_call_wait=0.1),
    rerun_state_machine=RerunStateMachineConfig(rerun_mode="validate_results"),
    checkpoint=SimpleNamespace(save=args.save, async_save=False),
    train=SimpleNamespace(train_iters=args.train_iters))
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.manual_seed(0)
model = torch.nn.Linear(16, 1)  # lives in the process: an in-process restart keeps it
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def forward_backward(batch):
    loss = model(batch).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= WORLD
    return loss.detach()


def pretrain(state, store=None, inprocess_call_wrapper=None):
    iteration = inprocess_call_wrapper.iteration if inprocess_call_wrapper is not None else 0
    if inprocess_call_wrapper is not None:  # Bridge's _pretrain: this iteration's process group
        store = dist.PrefixStore(str(iteration), store)
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    fault_tolerance.setup(cfg, state)
    fault_tolerance.maybe_setup_simulated_fault(cfg.ft)
    straggler = NVRxStragglerDetectionManager(cfg.nvrx_straggler)
    straggler.initialize()
    step_fn = straggler.wrap_train_step_function(forward_backward)
    rerun = RerunStateMachine(cfg.rerun_state_machine)
    while state.train_state.step < cfg.train.train_iters:
        fault_tolerance.on_training_step_start(state)
        if iteration == 0 and state.train_state.step == args.raise_at and RANK == WORLD - 1:
            raise RuntimeError(f"a fault at step {args.raise_at}")
        data = RerunDataIterator(iter([torch.randn(32, 16)]))
        while rerun.should_run_forward_backward(data):
            rerun.validate_result(step_fn(next(data)), torch.isnan, "loss is NaN", fatal=True)
        should_checkpoint, should_exit, exit_code = rerun.should_checkpoint_and_exit()
        if should_exit:
            raise SystemExit(exit_code)
        optimizer.step()
        state.train_state.step += 1
        fault_tolerance.on_training_step_end(state)
        if check_nvrx_straggler_detection(straggler):
            break
    safe_shutdown_nvrx_straggler_manager(straggler)
    fault_tolerance.shutdown(state)
    dist.destroy_process_group()
    if RANK == 0:
        print(f"done at step {state.train_state.step} after {iteration} in-process restart(s)", flush=True)


# Bridge's GlobalState, duck-typed: the step survives a restart here (Bridge reloads it from a checkpoint)
state = SimpleNamespace(cfg=cfg, train_state=SimpleNamespace(step=0), rank_monitor_client=None, async_calls_queue=None)
wrapped, store = maybe_wrap_for_inprocess_restart(pretrain, cfg.inprocess_restart, state)
wrapped(state, store=store)
