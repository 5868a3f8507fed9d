"""Megatron-Bridge's fault-tolerance hooks, on nvrx_core.ft: same function names and arguments.

A Bridge-style loop calls them where Bridge's does:

    fault_tolerance.setup(cfg, state)                # after torch.distributed is up: opens 'setup'
    for each iteration:
        fault_tolerance.on_training_step_start(state)  # closes 'setup', opens 'step'
        ...
        fault_tolerance.on_training_step_end(state)
    fault_tolerance.on_checkpointing_start(state) / on_checkpointing_end(False, state)
    fault_tolerance.shutdown(state)                  # clean end; abort(state) on a failure path

`global_state` is duck-typed like Bridge's GlobalState: `.cfg` (with `.ft`, `.checkpoint.save`,
`.checkpoint.async_save`, `.train.train_iters`), `.train_state.step` and `.rank_monitor_client`;
this run's `nvrx_core.ft.loop.MonitoredLoop` is kept as `.nvrx_ft_loop` (Bridge's own
`fault_tolerance_state` is left alone). `cfg.ft` may be any object with Bridge's
FaultToleranceConfig fields (Bridge's own class included): it is read by name, never called.
Every hook is a no-op when `cfg.ft` is None or `setup` did not run. A train state without a
step number (None, missing: a loop that counts elsewhere) loses only what needs the number:
the progress report, the resumed-at event, the finished flag.

The hooks map onto the loop, which owns every rule: Bridge's sections (`BRIDGE_SECTIONS`:
'setup' until the first training or eval step, 'step' around each step after the first of
training and of each evaluation, 'checkpointing' around saves and async finalisation) and
Bridge's learning rule (`PerTimeoutEvidence`, after each synchronous save and at shutdown,
when cfg.ft.calc_ft_timeouts). Beyond Bridge:
- a heartbeat after every step and save, so the job is protected, and never falsely killed,
  under heartbeat-only timeouts too (NeMo-Run's ft_launcher command sets only those);
- `shutdown` writes the finished flag (rank 0, durable) once train_state.step reached
  cfg.train.train_iters, so a scheduler's requeue loop ends;
- `abort` runs no collective (peers may be blocked in one) and learns nothing;
- no monitor (plain python, torchrun) is a warning, not a crash; no CUDA anywhere.
"""

import logging
import math
import operator
import os
from typing import Any, Optional

from nvrx_core import dist_env
from nvrx_core.ft.faults import FaultInjector
from nvrx_core.ft.learning_rules import PerTimeoutEvidence
from nvrx_core.ft.loop import MonitoredLoop, SectionRule
from nvrx_megatron import convert

logger = logging.getLogger("nvrx.megatron.ft")

BRIDGE_SECTIONS = SectionRule(first_step_in_setup=False, eval_warmup_steps=1, eval_ends_setup=True)
"""Bridge's: 'setup' ends at the first training or evaluation step, and the first step of
training and of each evaluation (NUM_WARMUP_ITERS) is in no section."""
MIN_ITERS_FOR_STEP_TIMEOUT_UPDATE = 16
LOOP_ATTRIBUTE = "nvrx_ft_loop"
"""Where the hooks keep this run's MonitoredLoop on the global state (Bridge keeps its own
counters in `fault_tolerance_state`, which is left to Bridge's code)."""


def setup(config: Any, global_state: Any) -> None:
    """Connect to the node monitor, load learned timeouts, open the 'setup' section."""
    checkpoint = getattr(config, "checkpoint", None)
    checkpoint_dir = getattr(checkpoint, "save", None)
    if not checkpoint_dir:
        raise ValueError("checkpoint.save: checkpointing save dir must be set to enable fault tolerance "
                         "(learned timeouts are kept there as ft_state.json)")
    ft_config = getattr(config, "ft", None)
    calc_timeouts = ft_config is not None and convert.bridge_fields(ft_config, "FaultToleranceConfig")[
        "calc_ft_timeouts"]
    if _rank() == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
    old = getattr(global_state, LOOP_ATTRIBUTE, None)
    if old is not None:
        old.close()
    loop = MonitoredLoop(checkpoint_dir, rank=_rank(), world_size=_world_size(),
                         rule=PerTimeoutEvidence(MIN_ITERS_FOR_STEP_TIMEOUT_UPDATE) if calc_timeouts else None,
                         sections=BRIDGE_SECTIONS, async_saves=bool(getattr(checkpoint, "async_save", False)),
                         logger=logger)
    setattr(global_state, LOOP_ATTRIBUTE, loop)
    global_state.rank_monitor_client = loop.client
    loop.begin()                                   # outside ft_launcher: warned once by the client


def on_training_step_start(global_state: Any) -> None:
    loop = _loop(global_state)
    if loop is not None:
        loop.step_begin(_step(global_state))


def on_training_step_end(global_state: Any) -> None:
    loop = _loop(global_state)
    if loop is not None:
        loop.step_end(_step(global_state))


def on_eval_step_start(global_state: Any) -> None:
    loop = _loop(global_state)
    if loop is not None:
        loop.eval_step_begin()


def on_eval_step_end(global_state: Any) -> None:
    loop = _loop(global_state)
    if loop is not None:
        loop.eval_step_end()


def on_checkpointing_start(global_state: Any) -> None:
    loop = _loop(global_state)
    if loop is not None:
        loop.checkpoint_begin()


def on_checkpointing_end(is_async_finalization: bool, global_state: Any) -> None:
    """Close 'checkpointing'; after a save (not an async finalisation, which runs before
    every step and is mostly a no-op) learn timeouts: every rank saves, a clean path."""
    loop = _loop(global_state)
    if loop is not None:
        loop.checkpoint_end(async_finalization=is_async_finalization)


def on_checkpoint_loaded(is_local_chkpt: bool, global_state: Any) -> None:
    """A persistent checkpoint's load time is what a restart's 'setup' must allow; a local
    (in-memory) one can be much faster, so it teaches nothing about 'setup'."""
    loop = _loop(global_state)
    if loop is not None:
        loop.checkpoint_loaded(persistent=not is_local_chkpt)


def shutdown(global_state: Any) -> None:
    """The clean end: learn timeouts (a collective: every rank is here), write the finished
    flag when training reached train_iters, leave the monitor."""
    loop = _loop(global_state)
    try:
        if loop is not None:
            loop.finish(completed=_training_completed(global_state))
    finally:
        _forget(global_state)


def abort(global_state: Any) -> None:
    """A failure path: no timeout learning (it is a collective and a peer may be blocked),
    no finished flag; leave the monitor."""
    loop = getattr(global_state, LOOP_ATTRIBUTE, None)
    try:
        if loop is not None:
            loop.fail()
    finally:
        _forget(global_state)


def maybe_setup_simulated_fault(config: Any) -> Optional[FaultInjector]:
    """Arm cfg.ft's simulated fault (a daemon thread fires it after the delay); the armed
    injector, or None. Every rank picks the same random rank from the same seed: no
    collective, so it works on CPU, with gloo and without torch.distributed. `config`: any
    object with Bridge's FaultToleranceConfig fields, or None."""
    fault = convert.simulated_fault(config)
    if fault is None:
        return None
    injector = FaultInjector(fault, rank=_rank(), world_size=_world_size())
    if injector.armed:
        logger.warning("simulated fault %s armed in rank %d: fires in %.1f s", injector.kind, injector.rank,
                       injector.delay)
        injector.start()
    return injector


# ---- plumbing -------------------------------------------------------------------------------

def _loop(global_state: Any) -> Optional[MonitoredLoop]:
    """This run's loop, or None: no `cfg.ft`, no setup, or not under ft_launcher."""
    if getattr(getattr(global_state, "cfg", None), "ft", None) is None:
        return None
    loop = getattr(global_state, LOOP_ATTRIBUTE, None)
    return loop if loop is not None and loop.active else None


def _forget(global_state: Any) -> None:
    setattr(global_state, LOOP_ATTRIBUTE, None)
    global_state.rank_monitor_client = None


def _step(global_state: Any) -> Optional[int]:
    """train_state.step as an int (an int, a numpy or 0-d tensor integer, a whole float), or
    None when there is no step number to report."""
    step = getattr(getattr(global_state, "train_state", None), "step", None)
    if step is None or isinstance(step, bool):
        return None
    try:
        return operator.index(step)
    except TypeError:
        pass
    if isinstance(step, float) and math.isfinite(step) and step.is_integer():
        return int(step)
    return None


def _training_completed(global_state: Any) -> bool:
    train = getattr(getattr(global_state, "cfg", None), "train", None)
    train_iters = getattr(train, "train_iters", None)
    if not train_iters:
        return False
    step = _step(global_state)
    if step is None:
        logger.warning("train_state.step is %r, not a step number: cannot tell whether training reached "
                       "train_iters=%s, so the finished flag is not written",
                       getattr(getattr(global_state, "train_state", None), "step", None), train_iters)
        return False
    return step >= train_iters


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return dist_env.rank()


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return dist_env.world_size()
