"""NVRxFaultTolerance: a Lightning fit watched by ft_launcher's node monitor.

    trainer = Trainer(callbacks=[NVRxFaultTolerance(), ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="last")          # under `ft_launcher --nproc-per-node N train.py`

The monitor kills a rank whose heartbeats stop or whose section stays open too long, and
ft_launcher restarts the job from the last checkpoint. This callback is the rank's side,
translated into Lightning's hooks; every mechanism is nvrx_core.ft's.

Liveness is sent in both vocabularies, so the rank is protected whichever timeouts the
launcher was given (NeMo-Run's ft_launcher command sets heartbeat timeouts only):
- 'setup' section from `setup` until the first training batch of the fit has ended: the
  start, the checkpoint restore, the sanity check and the first (compiling, autotuning)
  step are one long wait that the step timeout must not judge;
- 'step' section around every later training and validation batch, a heartbeat after it;
- 'checkpointing' section around `trainer.save_checkpoint`, heartbeats on both sides, and
  from `on_train_end` to `teardown`, where async saves are finalised.

Timeouts are learned on the clean path only: every rank runs `trainer.save_checkpoint`
(Lightning requires it) and `teardown` after a fit that ended normally, so the collective
in calculate_and_set_timeouts cannot meet a peer stuck elsewhere. They are learned once a
save has been observed (a heartbeat timeout learned from steps alone would kill the first
save) and, in a run that did not restore a checkpoint, without the start-up timeouts (a
restart that loads one takes longer). They persist in a state dir that does not move with
`trainer.log_dir`, and in this callback's `state_dict`, so they travel with the checkpoint.
"""

import contextlib
import dataclasses
import logging
import os
import tempfile
from typing import Any, Dict, Iterator, Mapping, Optional, Union

from nvrx_core.config import ConfigError, check
from nvrx_core.ft import finished
from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.ft.faults import FaultInjector, SimulatedFault

from nvrx_lightning._compat import Callback, EarlyStopping, Timer

SETUP, STEP, CHECKPOINTING = "setup", "step", "checkpointing"
STATE_DIR_NAME = "ft_state"
STARTUP_TIMEOUTS = ("initial_heartbeat", SETUP)
"""Timeouts a run that did not restore a checkpoint must not learn (see the module docstring)."""


class NVRxFaultTolerance(Callback):
    """Fault tolerance for `Trainer.fit` under ft_launcher; a logged no-op anywhere else.

    Args:
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
        check(isinstance(calculate_timeouts, bool), "calculate_timeouts", calculate_timeouts, "must be True or False")
        check(isinstance(write_finished_flag, bool), "write_finished_flag", write_finished_flag,
              "must be True or False")
        check(state_dir is None or isinstance(state_dir, (str, os.PathLike)), "state_dir", state_dir,
              "must be a directory path or None")
        self.calculate_timeouts = calculate_timeouts
        self.state_dir = None if state_dir is None else os.fspath(state_dir)
        self.write_finished_flag = write_finished_flag
        self.simulated_fault = _simulated_fault(simulated_fault)
        self._logger = logging.getLogger(logger_name)
        self._run: Optional[_FitRun] = None

    # ---- state that travels with the checkpoint ---------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        if self._run is not None and self._run.client.is_active:
            return self._run.client.state_dict()
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Called while restoring (after `setup`): learned timeouts from the checkpoint, merged
        with those from the state dir (the larger wins: neither may shrink a timeout)."""
        if not state_dict:
            return
        loaded = RankMonitorClient(socket_path="")
        loaded.load_state_dict(state_dict)
        if self._run is not None and self._run.client.is_active:
            client = self._run.client
            merged = client.calculated.merged_max(loaded.calculated)
            client.load_state_dict({**client.state_dict(), "calculated_timeouts": merged.to_json()})

    # ---- fit lifecycle ---------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        state_dir = self.state_dir or os.path.join(trainer.default_root_dir, STATE_DIR_NAME)
        _check_writable(state_dir, trainer.is_global_zero)
        client = RankMonitorClient()
        if not client.init_workload_monitoring():
            return                                  # logged once by the client: not under ft_launcher
        self._run = _FitRun(client, state_dir, trainer, self._logger)
        if self.calculate_timeouts:
            client.load_state(state_dir)
        self._run.start(SETUP)
        self._run.install_save_wrapper()
        if self.simulated_fault is not None:
            self._run.arm(self.simulated_fault)

    def on_train_start(self, trainer, pl_module) -> None:
        if self._run is not None:
            self._run.restored = trainer.ckpt_path is not None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._run is not None and self._run.steps > 0:
            self._run.start(STEP)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        run = self._run
        if run is None:
            return
        if run.injector is not None:            # inside the step: a hang is the step's
            run.injector.maybe_inject(trainer.global_step)
        run.end(SETUP if run.steps == 0 else STEP)  # the first step of a fit belongs to the start
        run.steps += 1
        run.client.send_heartbeat()
        run.client.report_progress(trainer.global_step)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self._run is not None and self._run.steps > 0:
            self._run.start(STEP)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._run is not None and self._run.steps > 0:
            self._run.end(STEP)
            self._run.client.send_heartbeat()

    def on_train_end(self, trainer, pl_module) -> None:
        if self._run is not None:
            self._run.client.send_heartbeat()
            self._run.start(CHECKPOINTING)      # async saves are finalised in strategy.teardown

    def teardown(self, trainer, pl_module, stage: str) -> None:
        """The clean end of a fit (an exception went through on_exception first)."""
        if stage != "fit" or self._run is None:
            return
        run, self._run = self._run, None
        try:
            run.client.end_all_sections()
            run.client.send_heartbeat()
            if self.calculate_timeouts:
                run.learn_timeouts()
            if self.write_finished_flag and trainer.is_global_zero and training_completed(trainer):
                path = finished.write_finished_flag()
                if path:
                    self._logger.info("training completed: wrote the finished flag %s", path)
        finally:
            run.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """No collective here (a peer may be blocked in one), no finished flag, no learning:
        give back what setup installed and leave the monitor."""
        if self._run is not None:
            run, self._run = self._run, None
            run.close()


class _FitRun:
    """What one fit installed and counted; dropped (and undone) at its end."""

    def __init__(self, client: RankMonitorClient, state_dir: str, trainer: Any, log: logging.Logger):
        self.client = client
        self.log = log
        self.state_dir = state_dir
        self.trainer = trainer
        self.steps = 0
        self.saves = 0
        self.learned = False
        """Learned at the first save that may (the others merge nothing new worth a
        collective) and once more at the clean end of the fit."""
        self.restored = False
        self.injector: Optional[FaultInjector] = None
        self._wrapped_save = False
        enforced = client.effective_timeouts
        self._sections = enforced.out_of_section is not None or any(
            v is not None for v in enforced.sections.values())
        """Sections are sent only to a monitor that enforces some (heartbeat-only launches
        would otherwise log "not enforced" for each name)."""

    def start(self, section: str) -> None:
        if self._sections:
            self.client.start_section(section)

    def end(self, section: str) -> None:
        if self._sections:
            self.client.end_section(section)

    def arm(self, fault: SimulatedFault) -> None:
        self.injector = FaultInjector(fault, rank=self.trainer.global_rank, world_size=self.trainer.world_size)
        self.injector.start()

    def install_save_wrapper(self) -> None:
        """Wrap this Trainer's save_checkpoint (an instance attribute, removed in close())."""
        original = self.trainer.save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> None:
            with self.saving():
                original(*args, **kwargs)
        self.trainer.save_checkpoint = save_checkpoint
        self._wrapped_save = True

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        client = self.client
        client.send_heartbeat()
        if not self.learned:
            self.learn_timeouts()                   # before the dump: state_dict() carries them
        self.start(CHECKPOINTING)
        try:
            yield
        finally:
            self.end(CHECKPOINTING)
            client.send_heartbeat()
        self.saves += 1

    def learn_timeouts(self) -> None:
        """Collective (every rank saves and tears down): see the module docstring for when."""
        no_saves_expected = not self.trainer.checkpoint_callbacks
        if self.steps < 2 or not (self.saves > 0 or no_saves_expected):
            return
        exclude = () if self.restored else STARTUP_TIMEOUTS
        if self.client.calculate_and_set_timeouts(skip_if_not_ready=True, exclude=exclude):
            self.learned = True
            self.log.info("fault tolerance timeouts learned: %s", self.client.effective_timeouts)
            if self.trainer.is_global_zero:
                self.client.save_state(self.state_dir)

    def close(self) -> None:
        if self._wrapped_save:
            vars(self.trainer).pop("save_checkpoint", None)
            self._wrapped_save = False
        if self.injector is not None:
            self.injector.armed = False
        self.client.shutdown_workload_monitoring()


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


def _simulated_fault(value: Union[SimulatedFault, Mapping[str, Any], None]) -> Optional[SimulatedFault]:
    if value is None or isinstance(value, SimulatedFault):
        return value
    check(isinstance(value, Mapping), "simulated_fault", value, "must be a SimulatedFault, a dict of its fields or None")
    known = {f.name for f in dataclasses.fields(SimulatedFault)}
    unknown = sorted(set(value) - known)
    check(not unknown, "simulated_fault", unknown, f"unknown fields; known: {sorted(known)}")
    try:
        return SimulatedFault(**value)
    except ConfigError as e:
        raise ConfigError(f"simulated_fault: {e}") from None


def _check_writable(state_dir: str, creates: bool) -> None:
    """Fail in setup, naming the argument, rather than at the first save of learned timeouts."""
    try:
        if creates:
            os.makedirs(state_dir, exist_ok=True)
        if os.path.isdir(state_dir):
            with tempfile.TemporaryFile(dir=state_dir):
                pass
    except OSError as e:
        raise ConfigError(f"state_dir={state_dir!r}: cannot write there ({e.strerror or e})") from None
