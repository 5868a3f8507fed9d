"""NVRxStragglerDetection: nvrx_core.straggler's Detector in a Lightning fit.

    trainer = Trainer(callbacks=[NVRxStragglerDetection(report_time_interval=60, stop_if_detected=True)])

Argument names are nvidia-resiliency-ext's StragglerDetectionCallback's, so a callback list
ports by changing the import; defaults are Megatron-Bridge's NVRxStragglerDetectionConfig's
(the peer's callback has none). Further StragglerConfig fields (consecutive_reports,
warmup_reports, gather_on_rank0, cuda_timing, control_file, ...) are accepted by their core
names after those.

What is timed: `trainer.strategy.training_step` (the forward and loss), as the peer does.
The backward pass is left out because DDP's gradient all-reduce runs inside it: there the
fast ranks wait for the slow one, so timing it would even the ranks out.

Every rank calls Detector.step() at the end of each training batch (DDP ranks see the same
number of batches); the few collectives it makes are on that clean path. On the step a
report is made, global rank 0, which holds the complete report, logs the peer's summaries
of the per-step scores (`gpu_relative_perf/min|median|max`, `gpu_individual_perf/...`)
through `pl_module.log_dict`; Lightning hands a value logged from a callback to the loggers
again at every later step of the epoch, until the next report replaces it. The report table
goes to `logger_name`, and events to the events file, as the core does it.

stop_if_detected: the report's stop decision is rank 0's, broadcast to all, so every rank
stops at the same step: it sets `trainer.should_stop`, saves through
`trainer.save_checkpoint` to `<dir>/last-straggler-stop-step=<global_step>.ckpt` (<dir>:
`dirpath`, else the first ModelCheckpoint's dirpath, else `<default_root_dir>/checkpoints`;
`fit(ckpt_path="last")` finds it in a ModelCheckpoint's directory), waits until it is
written on every rank, and exits with ExitCode.STRAGGLER_STOP (19) through Lightning's
exception path. The scores of the report that stops are in the log table and the events,
not in the Trainer's loggers (the process leaves before Lightning flushes that step).

The wrapper on `training_step` and the detector live for one fit: made in on_train_start,
removed in on_train_end, on_exception and teardown.
"""

import functools
import logging
import os
from typing import Any, Optional, Union

from nvrx_core.config import check
from nvrx_core.straggler import Detector, Report, callback_args

from nvrx_lightning._compat import Callback
from nvrx_lightning.preemption import checkpoint_dir, save_before_exit

logger = logging.getLogger("nvrx.lightning.straggler")

CHECKPOINT_PREFIX = "last-straggler-stop"
TIMED_SECTION = "training_step"


class NVRxStragglerDetection(Callback):
    """Straggler detection for `Trainer.fit`; see the module docstring.

    Args:
        report_time_interval: seconds between reports (all ranks agree on the step).
        calc_relative_gpu_perf: score each rank against the fastest rank.
        calc_individual_gpu_perf: score each rank against its own earlier reports.
        num_gpu_perf_scores_to_print: best and worst ranks in the logged table (0: the table
            only when a straggler is flagged).
        gpu_relative_perf_threshold / gpu_individual_perf_threshold: a score below this is
            bad (0.7: the rank takes 1.43x the time).
        stop_if_detected: on a flagged straggler, checkpoint and exit 19 on every rank.
        enable_ptl_logging: log score summaries to the Trainer's loggers.
        profiling_interval: time only every N-th step.
        logger_name: logger of the report table (None: "nvrx.lightning.straggler").
        dirpath: directory of the stop checkpoint (default: see the module docstring).
        **straggler_config: further nvrx_core StragglerConfig fields, by their names there.
    """

    def __init__(
        self,
        report_time_interval: float = 300.0,
        calc_relative_gpu_perf: bool = True,
        calc_individual_gpu_perf: bool = True,
        num_gpu_perf_scores_to_print: int = 5,
        gpu_relative_perf_threshold: float = 0.7,
        gpu_individual_perf_threshold: float = 0.7,
        stop_if_detected: bool = False,
        enable_ptl_logging: bool = True,
        profiling_interval: int = 1,
        logger_name: Optional[str] = "megatron.bridge.NVRxStragglerDetection",
        *,
        dirpath: Optional[Union[str, os.PathLike]] = None,
        **straggler_config: Any,
    ):
        check(isinstance(enable_ptl_logging, bool), "enable_ptl_logging", enable_ptl_logging, "must be True or False")
        check(dirpath is None or isinstance(dirpath, (str, os.PathLike)), "dirpath", dirpath,
              "must be a directory path or None")
        logger_name = logger.name if logger_name is None else logger_name
        self.config = callback_args.straggler_config(locals(), straggler_config, source=type(self).__name__)
        self.enable_ptl_logging = enable_ptl_logging
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self._detector: Optional[Detector] = None
        self._checkpoint_dir: Optional[str] = None
        self.last_report: Optional[Report] = None
        """The latest report of the current (or last) fit on this rank; complete on rank 0."""
        self.report_count = 0
        """Reports made in the current (or last) fit."""

    # ---- one detector per fit

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._close()
        self.last_report, self.report_count = None, 0
        self._checkpoint_dir = checkpoint_dir(trainer, self.dirpath)
        hook = functools.partial(self._save_before_stop, trainer) if self.config.stop_if_detected else None
        self._detector = Detector(self.config, checkpoint_hook=hook)
        self._detector.wrap_attribute(trainer.strategy, "training_step", name=TIMED_SECTION)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._detector is None:
            return
        report = self._detector.step()  # every rank; on a stop: checkpoint, SystemExit(19)
        if report is None:
            return
        self.last_report, self.report_count = report, self._detector.report_count
        if self.enable_ptl_logging and report.complete and trainer.is_global_zero:
            metrics = callback_args.score_summaries(report)
            if metrics:
                pl_module.log_dict(metrics, logger=True, batch_size=1, rank_zero_only=True)

    def _save_before_stop(self, trainer: Any, report: Report) -> None:
        """The Detector's checkpoint hook: every rank, same step, before it exits 19."""
        trainer.should_stop = True
        self.last_report, self.report_count = report, report.index
        path = os.path.join(self._checkpoint_dir, f"{CHECKPOINT_PREFIX}-step={trainer.global_step}.ckpt")
        logger.error("straggler stop (rank(s) %s flagged): saving %s", list(report.flagged_ranks), path)
        save_before_exit(trainer, path)

    # ---- undo, on every way out

    def _close(self) -> None:
        detector, self._detector = self._detector, None
        if detector is not None:
            detector.close()  # restores trainer.strategy.training_step

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()
