"""Megatron-Bridge's straggler manager, on nvrx_core.straggler's Detector.

A Bridge loop builds `NVRxStragglerDetectionManager(cfg.nvrx_straggler)`, calls
`initialize()`, runs `wrap_train_step_function(train_step)` instead of `train_step`, asks
`check_nvrx_straggler_detection(manager)` after every step ("should I checkpoint and
stop?") and ends with `safe_shutdown_nvrx_straggler_manager(manager)`. Those names,
signatures and answers are Bridge's; what differs is underneath:

- Each manager owns its Detector (Bridge's is a class-level singleton), so a second
  `pretrain` or an in-process restart starts clean and two managers do not collide.
- The stop flag is the detector's report.stop: rank 0 decides and the decision reaches
  every rank with the report, through nvrx_core.collectives, so the answer is the same on
  every rank and a gloo (CPU) job never touches CUDA (Bridge broadcasts a CUDA tensor).
- The detector never exits by itself here (exit_fn=None): the loop checkpoints and exits,
  as Bridge's does; ExitCode.STRAGGLER_STOP (19) is the code for that exit.
- The core flags a rank after `consecutive_reports` (2) bad reports in a row where Bridge
  acts on one: pass `consecutive_reports=1` to the manager for Bridge's behaviour.

A step is timed as one section, "train_step". A train step that ends in a gradient
all-reduce makes every rank wait for the slowest, so their times look alike: mark the
wait with `manager.section("grad_sync", kind="wait")` and it is left out of the score.
"""

import contextlib
import logging
import time
from typing import Any, Callable, ContextManager, List, Optional

import torch

from nvrx_core.events import EventLog
from nvrx_core.straggler import Detector, Report
from nvrx_megatron import convert

_CONFIG = "NVRxStragglerDetectionConfig"

TRAIN_STEP_SECTION = "train_step"
"""Section name the wrapped train step is timed under (it appears in reports and events)."""


class NVRxStragglerDetectionManager:
    """Bridge's manager: times the train step and answers "stop for a straggler?" each step.

    `config`: any object with Bridge's NVRxStragglerDetectionConfig fields (Bridge's own class,
    this package's, a SimpleNamespace), read by name; with `enabled=False` every method is a
    no-op (check_stragglers answers False). The keyword-only arguments are not Bridge's:
    `group` (process group scored over; default: the default group), `events`, `clock` and
    `timer` (injectable for tests), and `core_overrides`, StragglerConfig knobs Bridge has
    no field for (consecutive_reports, warmup_reports, control_file, ...).
    """

    def __init__(self, config: Any, *, group: Any = None,
                 events: Optional[EventLog] = None, clock: Callable[[], float] = time.monotonic,
                 timer: Callable[[], float] = time.perf_counter, **core_overrides: Any):
        core = convert.straggler_config(config, **core_overrides)  # a bad value is named here, not at initialize()
        self.config = config
        self.logger = logging.getLogger(core.logger_name)
        self.initialized = False
        self.wrapped_function: Optional[Callable] = None
        self.scores_to_compute: List[str] = []
        if core.calc_relative_perf:
            self.scores_to_compute.append("relative_perf_scores")
        if core.calc_individual_perf:
            self.scores_to_compute.append("individual_perf_scores")
        self.detector: Optional[Detector] = None
        """The core detector while initialized (None when disabled or shut down)."""
        self.last_report: Optional[Report] = None
        """The latest report this rank received (rank 0's is complete, the others hold the decision)."""
        self._group, self._events, self._clock, self._timer = group, events, clock, timer
        self._overrides = core_overrides

    def initialize(self) -> None:
        """Build this manager's detector. Raises RuntimeError when already initialized, as
        Bridge does; a disabled config makes it a no-op (callable any number of times)."""
        if self.initialized:
            raise RuntimeError("NVRxStragglerDetectionManager.initialize(): already initialized; "
                               "call shutdown() first")
        core = convert.straggler_config(self.config, **self._overrides)  # fields may have changed since __init__
        if not core.enabled:
            self.logger.debug("NVRx straggler detection is disabled")
            return
        self.detector = Detector(core, group=self._group, events=self._events, clock=self._clock,
                                 timer=self._timer, exit_fn=None)
        self.initialized = True
        self.logger.info("NVRx straggler detection enabled (report every %s s)", core.report_time_interval)

    def wrap_train_step_function(self, train_step_func: Callable) -> Callable:
        """`train_step_func` timed as the "train_step" section; the original when disabled or
        not initialized. A second call returns the first wrapper, as Bridge does."""
        if not callable(train_step_func):
            raise TypeError(f"train_step_func: expected a callable, got {type(train_step_func).__name__}")
        if not self._active():
            return train_step_func
        if self.wrapped_function is not None:
            self.logger.warning("train step function already wrapped; returning the first wrapper")
            return self.wrapped_function
        self.wrapped_function = self.detector.wrap(train_step_func, name=TRAIN_STEP_SECTION)
        return self.wrapped_function

    def section(self, name: str, kind: str = "compute") -> ContextManager:
        """Time a region of the step under `name` (kind "wait" for collectives: not scored);
        a no-op context when detection is off. Not in Bridge."""
        if not self._active():
            return contextlib.nullcontext()
        return self.detector.section(name, kind)

    def check_stragglers(self, global_rank: int) -> bool:
        """End one step; True when a straggler is flagged and stop_if_detected is on.

        Call it after every step on every rank (it is collective a few times per report
        interval). The answer is the same on every rank. `global_rank` is Bridge's argument
        and only checked: the detector knows its rank in the group it scores.
        """
        if not isinstance(global_rank, int) or isinstance(global_rank, bool) or global_rank < 0:
            raise ValueError(f"global_rank={global_rank!r}: must be an integer >= 0")
        if not self._active():
            return False
        started = time.monotonic()
        report = self.detector.step()
        if report is None:
            return False
        self.last_report = report
        self.logger.debug("straggler report %d handled in %.3f s", report.index, time.monotonic() - started)
        if report.stop:
            self.logger.error("stragglers detected (ranks %s): training should stop", list(report.flagged_ranks))
        return bool(report.stop)

    def shutdown(self) -> None:
        """Release the detector and the wrapper; initialize() may be called again."""
        if self.detector is not None:
            self.detector.close()
        self.detector = None
        self.initialized = False
        self.wrapped_function = None

    def _active(self) -> bool:
        return self.initialized and bool(convert.bridge_field(self.config, _CONFIG, "enabled"))


def check_nvrx_straggler_detection(nvrx_straggler_manager: Optional[NVRxStragglerDetectionManager]) -> bool:
    """Bridge's per-step question: should training checkpoint and exit for a straggler?
    False when there is no manager."""
    if nvrx_straggler_manager is None:
        return False
    if not hasattr(nvrx_straggler_manager, "check_stragglers"):
        raise TypeError(f"nvrx_straggler_manager: expected an NVRxStragglerDetectionManager or None, "
                        f"got {type(nvrx_straggler_manager).__name__}")
    dist = torch.distributed
    global_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return nvrx_straggler_manager.check_stragglers(global_rank)


def safe_shutdown_nvrx_straggler_manager(manager: Optional[NVRxStragglerDetectionManager],
                                         logger_name: str = "nvrx_straggler") -> None:
    """Shut `manager` down at the end of training; an error is logged, not raised, so it
    cannot hide the training's own outcome."""
    if manager is None:
        return
    try:
        manager.shutdown()
    except Exception as e:  # noqa: BLE001 - teardown must not mask the run's result
        logging.getLogger(logger_name).error("error shutting down NVRx straggler detection: %s", e)


__all__ = ["NVRxStragglerDetectionManager", "check_nvrx_straggler_detection", "safe_shutdown_nvrx_straggler_manager"]
