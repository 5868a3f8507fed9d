"""MonitoredLoop: a training loop's side of fault tolerance, written once for every framework.

A loop (Lightning's fit, a Megatron-style loop, the Hugging Face Trainer) tells this object what
it is doing, and it keeps the node monitor informed:

    loop = MonitoredLoop(state_dir, rank=rank, world_size=world, rule=AfterFirstSave())
    if loop.begin():                  # False outside ft_launcher: every other call is a no-op
        ...restore...; loop.checkpoint_loaded()
    for step in ...:
        loop.step_begin(step); ...; loop.step_end(step)
        loop.checkpoint_begin(); save(); loop.checkpoint_end()
    loop.finish(completed=...)        # the clean end; loop.fail() on a failure path

Liveness is sent in both vocabularies (a heartbeat after every step and save, and the 'setup',
'step' and 'checkpointing' sections where the monitor enforces any), so a job is protected, and
never falsely killed, whichever timeouts the launcher was given. Where sections begin and end
around the first steps is the loop's `SectionRule`; when timeouts are learned is its
`LearningRule` (`learning_rules.py`). Learned timeouts persist in `state_dir` (rank 0 writes)
and in `state_dict()`, which a framework saves with its checkpoint.
"""

import dataclasses
import logging
import os
import tempfile
from typing import Any, Dict, Mapping, Optional, Union

from nvrx_core.config import ConfigError, check
from nvrx_core.ft import finished
from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.ft.faults import FaultInjector, SimulatedFault, simulated_fault_from
from nvrx_core.ft.learning_rules import (AFTER_SAVE, BEFORE_SAVE, CHECKPOINTING, END, SETUP, STEP,
                                         AfterFirstSave, LearningRule, LoopProgress)


@dataclasses.dataclass(frozen=True)
class SectionRule:
    """Where 'setup' ends and 'step' begins: a run's first steps compile and warm caches, and
    the step timeout must not judge them."""

    first_step_in_setup: bool = True
    """The first training step of a run is part of 'setup' (else it is in no section)."""
    eval_warmup_steps: int = 0
    """Evaluation steps at the start of each evaluation left outside 'step'."""
    eval_ends_setup: bool = False
    """An evaluation before the first training step ends 'setup' (else it is part of it: a
    sanity check)."""


class MonitoredLoop:
    """One run of a training loop (a process's fit, pretrain or train call) under ft_launcher.

    Args:
        state_dir: where learned timeouts are kept between runs (None: not kept).
        rank, world_size: this process's global rank and the world size.
        rule: when to learn timeouts; None learns nothing.
        sections: where the first steps' sections go.
        load_learned: begin() loads the timeouts state_dir kept.
        simulated_fault: a fault to rehearse recovery (armed at begin()).
        async_saves, saves_expected: see LoopProgress.
    """

    def __init__(self, state_dir: Optional[str], rank: int, world_size: int,
                 rule: Optional[LearningRule] = None, sections: SectionRule = SectionRule(),
                 load_learned: bool = True, simulated_fault: Optional[SimulatedFault] = None,
                 async_saves: bool = False, saves_expected: bool = True,
                 logger: Optional[logging.Logger] = None):
        self.state_dir = state_dir
        self.rank = rank
        self.world_size = world_size
        self.rule = rule
        self.sections = sections
        self.load_learned = load_learned
        self.simulated_fault = simulated_fault
        self.progress = LoopProgress(async_saves=async_saves, saves_expected=saves_expected)
        self.log = logger or logging.getLogger("nvrx.ft.loop")
        self.client = RankMonitorClient()
        self.injector: Optional[FaultInjector] = None
        self._setup_open = False
        self._eval_steps = 0
        self._send_sections = False

    @property
    def active(self) -> bool:
        return self.client.is_active

    # ---- start ---------------------------------------------------------------------------
    def begin(self) -> bool:
        """Connect to the node monitor, load learned timeouts, open 'setup', arm the fault.
        False (and nothing else done) outside ft_launcher: logged once by the client."""
        if not self.client.init_workload_monitoring():
            return False
        enforced = self.client.effective_timeouts
        # Sections go only to a monitor that enforces some: a heartbeat-only launch (NeMo-Run's
        # command) would otherwise log "not enforced" for each name.
        self._send_sections = enforced.out_of_section is not None or any(
            v is not None for v in enforced.sections.values())
        if self.load_learned and self.state_dir:
            self.client.load_state(self.state_dir)
        self._start(SETUP)
        self._setup_open = True
        if self.simulated_fault is not None:
            self.injector = FaultInjector(self.simulated_fault, rank=self.rank, world_size=self.world_size)
            self.injector.start()
        return True

    def checkpoint_loaded(self, persistent: bool = True) -> None:
        """The run restored a checkpoint. A local (in-memory) one loads much faster than a
        persistent one, so it teaches nothing about a restart's start-up."""
        self.progress.restored = persistent

    # ---- steps ---------------------------------------------------------------------------
    def step_begin(self, step: Optional[int]) -> None:
        if not self.active:
            return
        progress = self.progress
        if progress.steps == 0 and step is not None:
            self.client.report_training_resumed(step)
        if progress.steps > 0 or not self.sections.first_step_in_setup:
            self._end_setup()
        if progress.steps > 0:
            self._start(STEP)
        self._eval_steps = 0                        # training resumed: any evaluation is over

    def step_end(self, step: Optional[int]) -> None:
        if not self.active:
            return
        if self.injector is not None and step is not None:
            self.injector.maybe_inject(step)        # inside the step: a hang is the step's
        if self.progress.steps > 0:
            self._end(STEP)
        else:
            self._end_setup()
        self.progress.steps += 1
        self.client.send_heartbeat()
        if step is not None:
            self.client.report_progress(step)

    def eval_step_begin(self) -> None:
        if not self.active:
            return
        if self.progress.steps == 0 and not self.sections.eval_ends_setup:
            return                                  # a sanity check: part of the start-up
        self._end_setup()
        if self._eval_steps >= self.sections.eval_warmup_steps:
            self._start(STEP)

    def eval_step_end(self) -> None:
        if not self.active:
            return
        if self.progress.steps == 0 and not self.sections.eval_ends_setup:
            return
        if self._eval_steps >= self.sections.eval_warmup_steps:
            self._end(STEP)
        self._eval_steps += 1
        self.client.send_heartbeat()

    def heartbeat(self) -> None:
        """Progress outside a training step (an evaluation batch the loop times no other way)."""
        if self.active:
            self.client.send_heartbeat()

    # ---- checkpoints ---------------------------------------------------------------------
    def checkpoint_begin(self) -> None:
        if not self.active:
            return
        self.client.send_heartbeat()
        self._learn(BEFORE_SAVE)
        self._start(CHECKPOINTING)

    def checkpoint_end(self, async_finalization: bool = False) -> None:
        """`async_finalization`: the end of a background save's finalisation (run before
        steps, mostly a no-op), which is not a save."""
        if not self.active:
            return
        self._end(CHECKPOINTING)
        self.client.send_heartbeat()
        if not async_finalization:
            self.progress.saves += 1
            self._learn(AFTER_SAVE)

    def finalizing(self) -> None:
        """Training is over; background saves are being finalised until finish()."""
        if self.active:
            self.client.send_heartbeat()
            self._start(CHECKPOINTING)

    # ---- end -----------------------------------------------------------------------------
    def finish(self, completed: bool) -> None:
        """The clean end, reached by every rank: learn timeouts (a collective), write the
        finished flag on rank 0 when training `completed` (so a scheduler stops requeueing),
        leave the monitor."""
        if not self.active:
            return
        try:
            self.client.end_all_sections()
            self.client.send_heartbeat()
            self._learn(END)
            if completed and self.rank == 0:
                path = finished.write_finished_flag()
                if path:
                    self.log.info("training completed: wrote the finished flag %s", path)
        finally:
            self.close()

    def fail(self) -> None:
        """A failure path: no collective (a peer may be blocked in one), no learning, no
        finished flag; close the sections and leave the monitor."""
        try:
            self.client.end_all_sections()
        finally:
            self.close()

    def close(self) -> None:
        if self.injector is not None:
            self.injector.armed = False
        self.client.shutdown_workload_monitoring()

    # ---- learned timeouts ------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return self.client.state_dict() if self.active else {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Learned timeouts from a checkpoint, merged with those already loaded: the larger
        of each wins, so neither source may shrink a timeout."""
        if not state_dict or not self.active:
            return
        loaded = RankMonitorClient(socket_path="")
        loaded.load_state_dict(state_dict)
        merged = self.client.calculated.merged_max(loaded.calculated)
        self.client.load_state_dict({**self.client.state_dict(), "calculated_timeouts": merged.to_json()})

    def _learn(self, moment: str) -> None:
        if self.rule is None:
            return
        excluded = self.rule.exclusions(moment, self.progress)
        if excluded is None:
            return
        if self.client.calculate_and_set_timeouts(skip_if_not_ready=True, exclude=excluded):
            self.progress.learned = True
            self.log.info("fault tolerance timeouts learned: %s", self.client.effective_timeouts)
            if self.rank == 0 and self.state_dir:
                self.client.save_state(self.state_dir)

    # ---- sections --------------------------------------------------------------------------
    def _start(self, section: str) -> None:
        if self._send_sections:
            self.client.start_section(section)

    def _end(self, section: str) -> None:
        if self._send_sections:
            self.client.end_section(section)

    def _end_setup(self) -> None:
        if self._setup_open:
            self._end(SETUP)
            self._setup_open = False


class CallbackArguments:
    """What a framework's fault-tolerance callback takes (Lightning's, the HF Trainer's), checked
    where it is given, and the MonitoredLoop each run of the framework's loop gets from it.

    Args:
        calculate_timeouts: learn timeouts from this job's own pace (`AfterFirstSave`) instead
            of keeping the launcher's loose defaults.
        state_dir: where learned timeouts are kept between runs (None: the framework's default).
        write_finished_flag: when training completed, global rank 0 writes the file named by
            FAULT_TOL_FINISHED_FLAG_FILE, so a scheduler stops resubmitting the job.
        simulated_fault: a fault to rehearse recovery (a SimulatedFault or a dict of its fields).
        logger_name: the logger the callback reports through.
    """

    def __init__(self, calculate_timeouts: bool = True, state_dir: Optional[Union[str, os.PathLike]] = None,
                 write_finished_flag: bool = True,
                 simulated_fault: Union[SimulatedFault, Mapping[str, Any], None] = None,
                 logger_name: str = "nvrx.ft.loop"):
        check(isinstance(calculate_timeouts, bool), "calculate_timeouts", calculate_timeouts, "must be True or False")
        check(isinstance(write_finished_flag, bool), "write_finished_flag", write_finished_flag,
              "must be True or False")
        check(state_dir is None or isinstance(state_dir, (str, os.PathLike)), "state_dir", state_dir,
              "must be a directory path or None")
        self.calculate_timeouts = calculate_timeouts
        self.state_dir = None if state_dir is None else os.fspath(state_dir)
        self.write_finished_flag = write_finished_flag
        self.simulated_fault = simulated_fault_from(simulated_fault)
        self.logger_name = logger_name
        self._logger = logging.getLogger(logger_name)

    def new_loop(self, default_state_dir: str, rank: int, world_size: int, saves_expected: bool) -> MonitoredLoop:
        """A loop for one run; its state dir is checked (and made by rank 0) first."""
        state_dir = self.state_dir or default_state_dir
        check_state_dir(state_dir, create=rank == 0)
        return MonitoredLoop(state_dir, rank=rank, world_size=world_size,
                             rule=AfterFirstSave() if self.calculate_timeouts else None,
                             load_learned=self.calculate_timeouts, simulated_fault=self.simulated_fault,
                             saves_expected=saves_expected, logger=self._logger)


def check_state_dir(state_dir: str, create: bool) -> None:
    """Fail at the start, naming the directory, rather than at the first save of learned
    timeouts. `create`: make it (one rank does; the others only check)."""
    try:
        if create:
            os.makedirs(state_dir, exist_ok=True)
        if os.path.isdir(state_dir):
            with tempfile.TemporaryFile(dir=state_dir):
                pass
    except OSError as e:
        raise ConfigError(f"state_dir={state_dir!r}: cannot write there ({e.strerror or e})") from None
