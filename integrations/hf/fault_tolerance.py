"""NVRxFaultTolerance: a Hugging Face Trainer watched by ft_launcher's node monitor.

    trainer = Trainer(model, args, train_dataset=..., callbacks=[NVRxFaultTolerance()])
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir))

The monitor kills a rank whose heartbeats stop or whose section stays open too long, and
ft_launcher restarts the job, which resumes from the Trainer's last checkpoint. This callback
maps the Trainer's events onto `nvrx_core.ft.loop.MonitoredLoop`, which owns every rule:
- 'setup' from `on_train_begin` (the checkpoint is loaded by then) until the first optimizer
  step has ended; 'step' around every later optimizer step (gradient accumulation's micro-batches
  included); a heartbeat after every step and every evaluation batch;
- 'checkpointing' from the step end where the Trainer decided to save (`control.should_save`;
  an evaluation due at that step runs inside it) until `on_save`. A save decided after an
  evaluation (`save_strategy="best"`) is covered by heartbeats only;
- timeouts learned with `AfterFirstSave` (every rank saves at the same step, so the collective
  cannot meet a peer stuck elsewhere) and kept in `state_dir`, and with each checkpoint in
  `trainer_state.json` (restored with `restore_callback_states_from_checkpoint=True`);
- at `on_train_end`, rank 0 writes the finished flag when training ended (max_steps reached,
  or a callback such as early stopping ended it; a preemption or straggler stop exits first).
The Trainer has no exception event: a failing rank leaves the monitor by exiting.
"""

import dataclasses
import os
from typing import Any, Dict, Mapping, Optional, Union

from nvrx_core.ft.faults import SimulatedFault
from nvrx_core.ft.loop import CallbackArguments, MonitoredLoop

from nvrx_hf._compat import ExportableState, TrainerCallback

STATE_DIR_NAME = "ft_state"


class NVRxFaultTolerance(TrainerCallback, ExportableState, CallbackArguments):
    """Fault tolerance for `Trainer.train` under ft_launcher; a logged no-op anywhere else.

    Args (nvrx_core.ft.loop.CallbackArguments): calculate_timeouts, state_dir (default
    `<args.output_dir>/ft_state`), write_finished_flag, simulated_fault (at_iteration is a
    global step), logger_name.
    """

    def __init__(self, calculate_timeouts: bool = True, state_dir: Optional[Union[str, os.PathLike]] = None,
                 write_finished_flag: bool = True,
                 simulated_fault: Union[SimulatedFault, Mapping[str, Any], None] = None,
                 logger_name: str = "nvrx.hf.ft"):
        CallbackArguments.__init__(self, calculate_timeouts, state_dir, write_finished_flag, simulated_fault,
                                   logger_name)
        self.checkpointed_timeouts: Dict[str, Any] = {}
        """Learned timeouts restored with a checkpoint (the Trainer sets it, see state())."""
        self._loop: Optional[MonitoredLoop] = None
        self._saving = False

    def state(self) -> Dict[str, Any]:
        """What the Trainer writes into each checkpoint's trainer_state.json."""
        fault = self.simulated_fault
        return {"args": {"calculate_timeouts": self.calculate_timeouts, "state_dir": self.state_dir,
                         "write_finished_flag": self.write_finished_flag, "logger_name": self.logger_name,
                         "simulated_fault": None if fault is None else dataclasses.asdict(fault)},
                "attributes": {"checkpointed_timeouts": self._loop.state_dict() if self._loop else {}}}

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        loop = self.new_loop(os.path.join(args.output_dir, STATE_DIR_NAME), args.process_index, args.world_size,
                             saves_expected=getattr(args.save_strategy, "value", args.save_strategy) != "no")
        if not loop.begin():
            return                                  # logged once by the client: not under ft_launcher
        self._loop, self._saving = loop, False
        if state.global_step > 0:                   # resumed from a checkpoint
            loop.checkpoint_loaded()
        loop.load_state_dict(self.checkpointed_timeouts)

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if self._loop is not None:
            self._loop.step_begin(state.global_step)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self._loop is None:
            return
        self._loop.step_end(state.global_step)
        if control.should_save:                     # the Trainer saves before the next step
            self._loop.checkpoint_begin()           # learns first: the checkpoint carries the result
            self._saving = True

    def on_prediction_step(self, args, state, control, **kwargs) -> None:
        if self._loop is not None:
            self._loop.heartbeat()

    def on_save(self, args, state, control, **kwargs) -> None:
        if self._loop is not None and self._saving:
            self._loop.checkpoint_end()
            self._saving = False

    def on_train_end(self, args, state, control, **kwargs) -> None:
        """Every rank is here after a training that ended normally: learning may collect."""
        loop, self._loop = self._loop, None
        if loop is not None:
            ended = state.global_step >= state.max_steps or control.should_training_stop
            loop.finish(completed=self.write_finished_flag and ended)
