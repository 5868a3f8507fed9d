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
`.checkpoint.async_save`, `.train.train_iters`), `.train_state.step`, `.rank_monitor_client`,
and `.fault_tolerance_state` (made here when missing). `cfg.ft` may be any object with
Bridge's FaultToleranceConfig fields (Bridge's own class included): it is read by name,
never called. Every hook is a no-op when `cfg.ft` is None or `setup` did not run.
A train state without a step number (None, missing: a loop that counts elsewhere) loses
only what needs the number: the progress report, the resumed-at event, the finished flag.

Sections as in Bridge: 'setup' from setup until the first training or eval step; 'step'
around each step after the first (a first step compiles and warms up); 'checkpointing'
around saves and async finalisation. Beyond Bridge:
- a heartbeat after every step and save, so the job is protected, and never falsely killed,
  under heartbeat-only timeouts too (NeMo-Run's ft_launcher command sets only those);
- `shutdown` writes the finished flag (rank 0, durable) once train_state.step reached
  cfg.train.train_iters, so a scheduler's requeue loop ends;
- `abort` runs no collective (peers may be blocked in one) and learns nothing;
- no monitor (plain python, torchrun) is a warning, not a crash; no CUDA anywhere.

Timeouts are learned (cfg.ft.calc_ft_timeouts) after each synchronous save and at shutdown,
with Bridge's rules for what may be learned yet: 'setup' (and the first heartbeat) only
after a persistent checkpoint was loaded, 'step' (and heartbeats) after 16 iterations,
'checkpointing' after a save and never with async saves (too variable), the out-of-section
timeout only at shutdown after all of those.
"""

import dataclasses
import logging
import math
import operator
import os
from typing import Any, List, Optional

from nvrx_core.ft import finished
from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.ft.faults import FaultInjector
from nvrx_megatron import convert

logger = logging.getLogger("nvrx.megatron.ft")

SETUP, STEP, CHECKPOINTING = "setup", "step", "checkpointing"
NUM_WARMUP_ITERS = 1
"""Steps (training, and eval per evaluation) left outside the 'step' section."""
MIN_ITERS_FOR_STEP_TIMEOUT_UPDATE = 16


@dataclasses.dataclass
class FaultToleranceState:
    """What the hooks count between calls (Bridge keeps it on GlobalState)."""

    ft_state_path: Optional[str] = None
    is_async_chkpt_enabled: bool = False
    is_calculating_timeouts: bool = False
    is_setup_section_open: bool = False
    seen_tr_iters_cnt: int = 0
    curr_eval_iter_idx: int = 0
    seen_checkpoints_cnt: int = 0
    is_persistent_chkpt_loaded: bool = False


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
    old = getattr(global_state, "rank_monitor_client", None)
    if old is not None:
        old.shutdown_workload_monitoring()
    state = _state(global_state)
    state.ft_state_path = os.path.join(checkpoint_dir, "ft_state.json")
    state.is_async_chkpt_enabled = bool(getattr(checkpoint, "async_save", False))
    state.is_calculating_timeouts = bool(calc_timeouts)
    client = RankMonitorClient()
    global_state.rank_monitor_client = client
    if not client.init_workload_monitoring():      # warned once by the client
        return
    client.load_state(checkpoint_dir)
    client.start_section(SETUP)
    state.is_setup_section_open = True


def on_training_step_start(global_state: Any) -> None:
    client = _client(global_state)
    if client is None:
        return
    state = _state(global_state)
    _close_setup(client, state)
    if state.seen_tr_iters_cnt == 0:
        step = _step(global_state)
        if step is not None:                       # no number: no resumed-at event, training goes on
            client.report_training_resumed(step)
    if state.seen_tr_iters_cnt >= NUM_WARMUP_ITERS:
        client.start_section(STEP)
    state.curr_eval_iter_idx = 0                   # training resumed: the evaluation is over


def on_training_step_end(global_state: Any) -> None:
    client = _client(global_state)
    if client is None:
        return
    state = _state(global_state)
    if state.seen_tr_iters_cnt >= NUM_WARMUP_ITERS:
        client.end_section(STEP)
    state.seen_tr_iters_cnt += 1
    client.send_heartbeat()
    step = _step(global_state)
    if step is not None:
        client.report_progress(step)


def on_eval_step_start(global_state: Any) -> None:
    client = _client(global_state)
    if client is None:
        return
    state = _state(global_state)
    _close_setup(client, state)                    # an evaluation may come before any training
    if state.curr_eval_iter_idx >= NUM_WARMUP_ITERS:
        client.start_section(STEP)


def on_eval_step_end(global_state: Any) -> None:
    client = _client(global_state)
    if client is None:
        return
    state = _state(global_state)
    if state.curr_eval_iter_idx >= NUM_WARMUP_ITERS:
        client.end_section(STEP)
    state.curr_eval_iter_idx += 1
    client.send_heartbeat()


def on_checkpointing_start(global_state: Any) -> None:
    client = _client(global_state)
    if client is not None:
        client.send_heartbeat()
        client.start_section(CHECKPOINTING)


def on_checkpointing_end(is_async_finalization: bool, global_state: Any) -> None:
    """Close 'checkpointing'; after a save (not an async finalisation, which runs before
    every step and is mostly a no-op) learn timeouts: every rank saves, a clean path."""
    client = _client(global_state)
    if client is None:
        return
    client.end_section(CHECKPOINTING)
    client.send_heartbeat()
    if not is_async_finalization:
        _state(global_state).seen_checkpoints_cnt += 1
        _maybe_update_timeouts(global_state, closing=False)


def on_checkpoint_loaded(is_local_chkpt: bool, global_state: Any) -> None:
    """A persistent checkpoint's load time is what a restart's 'setup' must allow; a local
    (in-memory) one can be much faster, so it teaches nothing about 'setup'."""
    if _ft_config(global_state) is not None:
        _state(global_state).is_persistent_chkpt_loaded = not is_local_chkpt


def shutdown(global_state: Any) -> None:
    """The clean end: learn timeouts (a collective: every rank is here), write the finished
    flag when training reached train_iters, leave the monitor."""
    client = _client(global_state)
    try:
        if client is not None:
            _maybe_update_timeouts(global_state, closing=True)
            if _rank() == 0 and _training_completed(global_state):
                path = finished.write_finished_flag()
                if path:
                    logger.info("training completed: wrote the finished flag %s", path)
    finally:
        if client is not None:
            client.shutdown_workload_monitoring()
        global_state.rank_monitor_client = None


def abort(global_state: Any) -> None:
    """A failure path: no timeout learning (it is a collective and a peer may be blocked),
    no finished flag; leave the monitor."""
    client = getattr(global_state, "rank_monitor_client", None)
    try:
        if client is not None:
            client.end_all_sections()
    finally:
        if client is not None:
            client.shutdown_workload_monitoring()
        global_state.rank_monitor_client = None


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

def _ft_config(global_state: Any) -> Any:
    return getattr(getattr(global_state, "cfg", None), "ft", None)


def _client(global_state: Any) -> Optional[RankMonitorClient]:
    if _ft_config(global_state) is None:
        return None
    client = getattr(global_state, "rank_monitor_client", None)
    return client if client is not None and client.is_active else None


def _state(global_state: Any) -> FaultToleranceState:
    state = getattr(global_state, "fault_tolerance_state", None)
    if state is None:
        state = FaultToleranceState()
        global_state.fault_tolerance_state = state
    return state


def _close_setup(client: RankMonitorClient, state: FaultToleranceState) -> None:
    if state.is_setup_section_open:
        client.end_section(SETUP)
        state.is_setup_section_open = False


def _maybe_update_timeouts(global_state: Any, closing: bool) -> None:
    state = _state(global_state)
    if not state.is_calculating_timeouts:
        return
    excluded = _not_learnable_yet(state, closing)
    client = global_state.rank_monitor_client
    if client.calculate_and_set_timeouts(skip_if_not_ready=True, exclude=excluded) and _rank() == 0:
        client.save_state(os.path.dirname(state.ft_state_path))


def _not_learnable_yet(state: FaultToleranceState, closing: bool) -> List[str]:
    """Bridge's rules for which timeouts this run has seen enough of (heartbeats follow the
    sections whose waits they span)."""
    excluded = []
    if not state.is_persistent_chkpt_loaded:
        excluded += [SETUP, "initial_heartbeat"]
    steps_seen = state.seen_tr_iters_cnt >= MIN_ITERS_FOR_STEP_TIMEOUT_UPDATE
    if not steps_seen:
        excluded.append(STEP)
    saves_seen = state.seen_checkpoints_cnt > 0
    if not saves_seen or state.is_async_chkpt_enabled:
        excluded.append(CHECKPOINTING)
    if not (steps_seen and saves_seen):
        excluded.append("heartbeat")                # a gap between heartbeats may span a save
    if not (closing and SETUP not in excluded and steps_seen and saves_seen):
        excluded.append("out_of_section")
    return excluded


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
    return int(os.environ.get("RANK", 0))


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))
