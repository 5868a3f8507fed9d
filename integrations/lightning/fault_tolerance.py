"""NVRxFaultTolerance: a Lightning fit watched by ft_launcher's node monitor.

    trainer = Trainer(callbacks=[NVRxFaultTolerance(), ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="last")          # under `ft_launcher --nproc-per-node N train.py`

The monitor kills a rank whose heartbeats stop or whose section stays open too long, and
ft_launcher restarts the job from the last checkpoint. This callback maps Lightning's hooks
onto `nvrx_core.ft.loop.MonitoredLoop`, which owns every rule:
- 'setup' from `setup` until the first training batch of the fit has ended (the start, the
  checkpoint restore, the sanity check and the first, compiling step); 'step' around every
  later training and validation batch; 'checkpointing' around `trainer.save_checkpoint` and
  from `on_train_end` to `teardown`, where async saves are finalised;
- timeouts learned with `AfterFirstSave`: every rank runs `trainer.save_checkpoint` (Lightning
  requires it) and `teardown` after a fit that ended normally, so the collective cannot meet a
  peer stuck elsewhere. They persist in a state dir that does not move with
  `trainer.log_dir`, and in this callback's `state_dict`, so they travel with the checkpoint.
"""

import contextlib
import os
from typing import Any, Dict, Iterator, Mapping, Optional, Union

from nvrx_core.ft.faults import SimulatedFault
from nvrx_core.ft.loop import CallbackArguments, MonitoredLoop

from nvrx_lightning._compat import Callback, EarlyStopping, Timer

STATE_DIR_NAME = "ft_state"


class NVRxFaultTolerance(Callback, CallbackArguments):
    """Fault tolerance for `Trainer.fit` under ft_launcher; a logged no-op anywhere else.

    Args (nvrx_core.ft.loop.CallbackArguments):
        calculate_timeouts: learn timeouts from this job's own pace (safety_factor x the
            longest interval seen, the launcher's --ft-safety-factor) instead of keeping the
            launcher's loose defaults.
        state_dir: where learned timeouts are kept between runs; default
            `<trainer.default_root_dir>/ft_state` (not `log_dir`, which Lightning versions).
        write_finished_flag: when training completed (max_steps, max_epochs, max_time or an
            EarlyStopping stop), global rank 0 writes the file named by
            FAULT_TOL_FINISHED_FLAG_FILE, so a scheduler stops resubmitting the job.
        simulated_fault: a fault to rehearse recovery (nvrx_core.ft.faults.SimulatedFault or
            a dict of its fields: fault_type in rank_killed / rank_hung / rank_exception /
            random, rank_to_fail, and base_delay (seconds) or at_iteration (global step)).
        logger_name: the logger this callback reports through.
    """

    def __init__(self, calculate_timeouts: bool = True, state_dir: Optional[Union[str, os.PathLike]] = None,
                 write_finished_flag: bool = True,
                 simulated_fault: Union[SimulatedFault, Mapping[str, Any], None] = None,
                 logger_name: str = "nvrx.lightning.ft"):
        CallbackArguments.__init__(self, calculate_timeouts, state_dir, write_finished_flag, simulated_fault,
                                   logger_name)
        self._loop: Optional[MonitoredLoop] = None
        self._trainer: Any = None

    # ---- state that travels with the checkpoint ---------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return self._loop.state_dict() if self._loop is not None else {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Called while restoring (after `setup`): merged with the state dir's timeouts."""
        if self._loop is not None:
            self._loop.load_state_dict(state_dict)

    # ---- fit lifecycle ---------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        loop = self.new_loop(os.path.join(trainer.default_root_dir, STATE_DIR_NAME), trainer.global_rank,
                             trainer.world_size, saves_expected=bool(trainer.checkpoint_callbacks))
        if not loop.begin():
            return                                  # logged once by the client: not under ft_launcher
        self._loop = loop
        self._install_save_wrapper(trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        if self._loop is not None and trainer.ckpt_path is not None:
            self._loop.checkpoint_loaded()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._loop is not None:
            self._loop.step_begin(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._loop is not None:
            self._loop.step_end(trainer.global_step)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self._loop is not None:
            self._loop.eval_step_begin()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._loop is not None:
            self._loop.eval_step_end()

    def on_train_end(self, trainer, pl_module) -> None:
        if self._loop is not None:
            self._loop.finalizing()                 # async saves are finalised in strategy.teardown

    def teardown(self, trainer, pl_module, stage: str) -> None:
        """The clean end of a fit (an exception went through on_exception first)."""
        if stage != "fit" or self._loop is None:
            return
        loop = self._take_loop()
        loop.finish(completed=self.write_finished_flag and training_completed(trainer))

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self._loop is not None:
            self._take_loop().fail()

    # ---- Trainer.save_checkpoint, wrapped for the fit ----------------------------------------
    def _install_save_wrapper(self, trainer: Any) -> None:
        """An instance attribute on this Trainer, removed when the fit ends."""
        original = trainer.save_checkpoint
        loop = self._loop

        def save_checkpoint(*args: Any, **kwargs: Any) -> None:
            with _saving(loop):
                original(*args, **kwargs)
        trainer.save_checkpoint = save_checkpoint
        self._trainer = trainer

    def _take_loop(self) -> MonitoredLoop:
        loop, self._loop = self._loop, None
        if self._trainer is not None:
            vars(self._trainer).pop("save_checkpoint", None)
            self._trainer = None
        return loop


@contextlib.contextmanager
def _saving(loop: MonitoredLoop) -> Iterator[None]:
    loop.checkpoint_begin()                         # learns first: state_dict() carries the result
    try:
        yield
    finally:
        loop.checkpoint_end()


def training_completed(trainer: Any) -> bool:
    """Did the fit end because training is done (not a failure, a preemption or a stop)?"""
    if trainer.interrupted:
        return False
    max_steps = trainer.max_steps
    if isinstance(max_steps, int) and max_steps > 0 and trainer.global_step >= max_steps:
        return True
    max_epochs = trainer.max_epochs
    if isinstance(max_epochs, int) and max_epochs > 0 and trainer.current_epoch >= max_epochs:
        return True
    for callback in trainer.callbacks:
        if isinstance(callback, Timer) and callback.time_remaining() is not None and callback.time_remaining() <= 0:
            return True
        if isinstance(callback, EarlyStopping) and callback.stopped_epoch > 0:
            return True
    return False
