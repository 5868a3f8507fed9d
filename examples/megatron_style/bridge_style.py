"""A reference Megatron-Bridge-style trainer on nvrx_megatron: `pretrain(cfg, forward_step_func)`.

What Bridge's training loop does with resiliency, in a few hundred lines: its ConfigContainer
fields (`train`, `checkpoint`, `ft`, `nvrx_straggler`, `inprocess_restart`,
`rerun_state_machine`), and every nvrx_megatron hook called where Bridge calls it. A Bridge
user's loop ports by changing imports; this file shows where each import's functions go.
CPU / gloo by default, NCCL on CUDA when present.

Checkpoints are one torch.save file (rank 0, written atomically), holding the model, the
optimizer, the iteration and the rerun state machine's state. Gradients are averaged after the
backward passes, as Megatron's finalize_model_grads does; with the straggler manager on, that
all-reduce is timed as a "wait" section, so the time a fast rank spends waiting for a slow one
is not counted against it.
"""

import contextlib
import dataclasses
import functools
import logging
import os
import sys
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from nvrx_core.durable import atomic_write_with
from nvrx_core.exit_codes import ExitCode
from nvrx_core.inprocess.replacement import respawn_on
from nvrx_core.inprocess.roll_forward import roll_forward
from nvrx_megatron import (FaultToleranceConfig, InProcessRestartConfig, NVRxStragglerDetectionConfig,
                           RerunStateMachineConfig)
from nvrx_megatron import fault_tolerance

logger = logging.getLogger("megatron_style")


@dataclasses.dataclass
class TrainConfig:
    train_iters: int = 100
    micro_batch_size: int = 8
    seed: int = 1234
    exit_signal_handler: bool = False
    """Stop every rank at the same iteration on SIGTERM to any one rank (save, exit 18)."""
    exit_signal_handler_for_dataloader: bool = False
    """Bridge's flag for DataLoader workers; this trainer's loader has none, so it changes nothing."""


@dataclasses.dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: int = 10
    async_save: bool = False


@dataclasses.dataclass
class ConfigContainer:
    """Bridge's container, reduced to the fields this trainer reads."""

    train: TrainConfig
    checkpoint: CheckpointConfig
    ft: Optional[FaultToleranceConfig] = None
    nvrx_straggler: Optional[NVRxStragglerDetectionConfig] = None
    inprocess_restart: Optional[InProcessRestartConfig] = None
    rerun_state_machine: RerunStateMachineConfig = dataclasses.field(default_factory=RerunStateMachineConfig)


@dataclasses.dataclass
class TrainState:
    step: int = 0


@dataclasses.dataclass
class GlobalState:
    """The attributes nvrx_megatron's hooks read, as on Bridge's GlobalState."""

    cfg: ConfigContainer
    train_state: TrainState = dataclasses.field(default_factory=TrainState)
    rank_monitor_client: Any = None
    fault_tolerance_state: Any = None
    nvrx_straggler_manager: Any = None
    exit_code: Optional[int] = None
    """What the last run ended with (0, or a stop's code); not on Bridge's GlobalState."""
    kept: Any = None
    """Under ft_launcher --ft-restart-policy respawn-rank: (model, optimizer, committed iteration),
    kept across in-process restarts, which roll forward instead of reloading the checkpoint
    (not on Bridge's GlobalState)."""

    def reset_for_restart(self) -> None:
        """Before an in-process restart calls the training function again (Bridge's name): the
        loop's state starts over from the checkpoint; the old monitor client is kept so setup
        can close it, and so is the straggler manager (the failed call shut it down, the next
        one initializes it again: a fresh detector, with the clock it was built with)."""
        self.train_state = TrainState()
        self.fault_tolerance_state = None
        self.exit_code = None


class StopTraining(Exception):
    """A clean, agreed stop (straggler, preemption signal, rerun verdict) with its exit code."""

    def __init__(self, exit_code: int, why: str, checkpoint: bool = True):
        super().__init__(why)
        self.exit_code = exit_code
        self.checkpoint = checkpoint


def pretrain(cfg: ConfigContainer, forward_step_func: Callable, model_provider: Callable[[], torch.nn.Module],
             data_iterator_provider: Callable[[int], Iterator], state: Optional[GlobalState] = None) -> int:
    """Train to cfg.train.train_iters; returns the process exit code (0, or a stop's code).
    Pass `state` to look at the run afterwards (its iteration, the straggler manager's report),
    or to hand the run a straggler manager of your own on `state.nvrx_straggler_manager` (one
    built with its own clock, timer, process group or event log); without one, the run builds
    it from cfg.nvrx_straggler."""
    state = state if state is not None else GlobalState(cfg)
    train = _train
    store = None
    if cfg.inprocess_restart is not None:
        from nvrx_megatron.inprocess_restart import maybe_wrap_for_inprocess_restart

        train, store = maybe_wrap_for_inprocess_restart(_train, cfg.inprocess_restart, state)
    if store is not None:
        return train(state, forward_step_func, model_provider, data_iterator_provider, store=store)
    return train(state, forward_step_func, model_provider, data_iterator_provider)


def _train(state: GlobalState, forward_step_func, model_provider, data_iterator_provider, **inprocess: Any) -> int:
    cfg = state.cfg
    _init_distributed(inprocess.get("store"))
    if cfg.ft is not None and cfg.ft.enable_ft_package:
        fault_tolerance.setup(cfg, state)
        fault_tolerance.maybe_setup_simulated_fault(cfg.ft)
    else:
        cfg.ft = None                          # the hooks are no-ops, as in Bridge
    rerun = _rerun_machine(cfg)
    restart = inprocess.get("inprocess_call_wrapper")
    if restart is not None and respawn_on(os.environ):
        model, optimizer, start = _roll_forward(cfg, state, model_provider, rerun, restart)
    else:
        model, optimizer = _build(cfg, model_provider)
        start = _load_checkpoint(cfg, state, model, optimizer, rerun)
    atomic = restart.atomic if restart is not None else contextlib.nullcontext
    data = data_iterator_provider(start)
    if rerun is not None:                      # a rerun replays the step's microbatches
        from nvrx_megatron.rerun_state_machine import RerunDataIterator

        data = RerunDataIterator(data)

    straggler = _straggler_manager(cfg, state)
    train_step = functools.partial(_train_step, cfg=cfg, straggler=straggler, state=state, atomic=atomic)
    if straggler is not None:
        train_step = straggler.wrap_train_step_function(train_step)
    signals = _signal_handler(cfg)
    exit_code = 0
    try:
        while state.train_state.step < cfg.train.train_iters:
            fault_tolerance.on_training_step_start(state)
            loss = train_step(forward_step_func, data, model, optimizer, rerun)
            fault_tolerance.on_training_step_end(state)
            if state.train_state.step % cfg.checkpoint.save_interval == 0:
                _save_checkpoint(cfg, state, model, optimizer, rerun)
            _check_stops(cfg, state, straggler, signals, rerun)
            if dist.get_rank() == 0 and state.train_state.step % 10 == 0:
                logger.info("iteration %d loss %.4f", state.train_state.step, loss)
    except StopTraining as stop:
        if stop.checkpoint:
            _save_checkpoint(cfg, state, model, optimizer, rerun)
        logger.warning("stopping at iteration %d: %s (exit %d)", state.train_state.step, stop, stop.exit_code)
        exit_code = int(stop.exit_code)
        fault_tolerance.abort(state)           # not a completed run: no finished flag
    except BaseException:
        fault_tolerance.abort(state)           # no collective: a peer may be stuck in one
        raise
    else:
        fault_tolerance.shutdown(state)        # learns timeouts, writes the finished flag
    finally:
        state.exit_code = exit_code
        if straggler is not None:
            from nvrx_megatron.nvrx_straggler import safe_shutdown_nvrx_straggler_manager

            safe_shutdown_nvrx_straggler_manager(straggler)
        if signals is not None:
            signals.release()
    return exit_code


def _build(cfg, model_provider, sync: bool = True):
    torch.manual_seed(cfg.train.seed)
    model = model_provider().to(_device())
    for p in model.parameters() if sync else ():  # every rank starts from rank 0's weights
        dist.broadcast(p.data, src=0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _roll_forward(cfg, state, model_provider, rerun, restart):
    """respawn-rank (docs/respawn.md): the model and optimizer live as long as the process; a
    restart takes the newest committed iteration from the ranks that kept theirs (a replacement
    of a dead rank holds none) instead of the checkpoint, and nothing is redone."""
    if state.kept is None:                     # this process's first call
        fresh = restart.rank in restart.respawned  # alone in its first call: roll_forward syncs it
        model, optimizer = _build(cfg, model_provider, sync=not fresh)
        committed = None if fresh else _load_checkpoint(cfg, state, model, optimizer, rerun)
        state.kept = [model, optimizer, committed]
    model, optimizer, committed = state.kept
    state.kept[2] = state.train_state.step = roll_forward(restart, committed, {"model": model, "optimizer": optimizer})
    return model, optimizer, state.train_state.step


def _train_step(forward_step_func, data, model, optimizer, rerun, cfg, straggler, state, atomic) -> float:
    """One iteration; the rerun state machine may ask to run the forward/backward again. The
    optimizer step and the iteration count are one unit: a restart never finds one without the
    other."""
    loss_value = float("nan")
    while rerun is None or rerun.should_run_forward_backward(data):
        optimizer.zero_grad(set_to_none=True)
        output, loss_func = forward_step_func(data, model)
        loss = loss_func(output)
        if rerun is not None:
            _validate_loss(rerun, cfg.rerun_state_machine, loss.detach())
        loss.backward()
        loss_value = float(loss.detach())
        if rerun is None:
            break
    if rerun is not None:                      # Megatron asks after the loop, before the optimizer step
        should_checkpoint, should_exit, exit_code = rerun.should_checkpoint_and_exit()
        if should_exit:
            raise StopTraining(exit_code, "rerun state machine verdict", checkpoint=should_checkpoint)
    _finalize_model_grads(model, straggler)
    with atomic():
        optimizer.step()
        state.train_state.step += 1
        if state.kept is not None:
            state.kept[2] = state.train_state.step
    return loss_value


def _validate_loss(rerun, config: RerunStateMachineConfig, loss: torch.Tensor) -> None:
    """Bridge's two loss checks: NaN (fatal) and, when asked for, a spike (not fatal)."""
    if config.check_for_nan_in_loss:
        rerun.validate_result(result=loss, rejection_func=torch.isnan,
                              message="found NaN in local forward loss calculation", tolerance=0.0, fatal=True)
    if config.check_for_spiky_loss:
        spiky = functools.partial(rerun.is_unexpectedly_large, threshold=config.spiky_loss_factor, context="loss")
        rerun.validate_result(result=loss, rejection_func=spiky, message="Spiky loss", tolerance=0.0, fatal=False)


def _finalize_model_grads(model: torch.nn.Module, straggler) -> None:
    """Average the gradients over the ranks (one flat all-reduce)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    with straggler.section("grad_sync", kind="wait") if straggler is not None else contextlib.nullcontext():
        dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _check_stops(cfg, state, straggler, signals, rerun) -> None:
    """Bridge's agreed stops, all on the clean path at the end of an iteration."""
    if straggler is not None:
        from nvrx_megatron.nvrx_straggler import check_nvrx_straggler_detection

        if check_nvrx_straggler_detection(straggler):
            raise StopTraining(ExitCode.STRAGGLER_STOP, "stragglers detected")
    if signals is not None and any(signals.signals_received(state.train_state.step)):
        raise StopTraining(ExitCode.PREEMPTED, "preemption signal received")

# ---- the parts each config switches on -----------------------------------------------------

def _straggler_manager(cfg: ConfigContainer, state: GlobalState):
    """The manager already on state.nvrx_straggler_manager if the caller put one there, else
    one built from cfg.nvrx_straggler (None when that is off); initialized unless it is."""
    manager = state.nvrx_straggler_manager
    if manager is None:
        if cfg.nvrx_straggler is None or not cfg.nvrx_straggler.enabled:
            return None
        from nvrx_megatron.nvrx_straggler import NVRxStragglerDetectionManager

        manager = state.nvrx_straggler_manager = NVRxStragglerDetectionManager(cfg.nvrx_straggler)
    if not manager.initialized:
        manager.initialize()
    return manager


def _signal_handler(cfg: ConfigContainer):
    if not cfg.train.exit_signal_handler:
        return None
    from nvrx_megatron.dist_signal_handler import DistributedSignalHandler

    return DistributedSignalHandler().__enter__()


def _rerun_machine(cfg: ConfigContainer):
    if cfg.rerun_state_machine.rerun_mode == "disabled":
        return None
    from nvrx_megatron.rerun_state_machine import RerunStateMachine

    return RerunStateMachine(cfg.rerun_state_machine)


# ---- distributed and checkpoints ---------------------------------------------------------------

def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _init_distributed(store: Any) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if store is not None:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend)


def _checkpoint_path(directory: str) -> str:
    return os.path.join(directory, "checkpoint.pt")


def _load_checkpoint(cfg, state, model, optimizer, rerun) -> int:
    directory = cfg.checkpoint.load or cfg.checkpoint.save
    if not directory or not os.path.exists(_checkpoint_path(directory)):
        return 0
    saved = torch.load(_checkpoint_path(directory), map_location="cpu", weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    if rerun is not None and saved.get("rerun_state_machine") is not None:
        rerun.load_state_dict(saved["rerun_state_machine"])
    state.train_state.step = saved["iteration"]
    fault_tolerance.on_checkpoint_loaded(False, state)
    return state.train_state.step


def _save_checkpoint(cfg, state, model, optimizer, rerun) -> None:
    if not cfg.checkpoint.save:
        return
    fault_tolerance.on_checkpointing_start(state)
    snapshot = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "iteration": state.train_state.step,
                "rerun_state_machine": rerun.state_dict(data_iterator=None) if rerun is not None else None}
    if dist.get_rank() == 0:
        atomic_write_with(_checkpoint_path(cfg.checkpoint.save), lambda f: torch.save(snapshot, f))
    dist.barrier()
    fault_tolerance.on_checkpointing_end(False, state)


if __name__ == "__main__":
    sys.exit("run examples/megatron_style/pretrain_gpt.py")
