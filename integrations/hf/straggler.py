"""NVRxStragglerDetection: nvrx_core.straggler's Detector in a Hugging Face `Trainer.train`.

    trainer = Trainer(model, args, callbacks=[NVRxStragglerDetection(report_time_interval=60)])

Argument names are nvidia-resiliency-ext's StragglerDetectionCallback's (as nvrx_lightning's
callback takes them, without the Lightning-only `enable_ptl_logging`), so a callback list
ports by changing the import; defaults are Megatron-Bridge's NVRxStragglerDetectionConfig's.
Further StragglerConfig fields (consecutive_reports, warmup_reports, gather_on_rank0,
cuda_timing, control_file, ...) are accepted by their core names after those.

What is timed: the model's `forward` (the `model` the Trainer hands its callbacks, which DDP
calls inside its own forward). The backward pass is left out because DDP's gradient
all-reduce runs inside it: there the fast ranks wait for the slow one, so timing it would
even the ranks out. With gradient accumulation a step's time is its micro-batches' sum.

Every rank calls `Detector.step()` in `on_step_end` (every rank reaches it at the same global
steps); the few collectives it makes are on that clean path. The report table goes to
`logger_name` and the events to the events file, as the core does it. On global rank 0, which
holds the complete report, the peer's summaries of the scores (`gpu_relative_perf/min|median|
max`, `gpu_individual_perf/...`) are added to the Trainer's next log entry: its `state.log_history`
(kept in each checkpoint's trainer_state.json) and the printed log line. They do not reach
`report_to` integrations: the Trainer calls those before any user callback's `on_log`.

stop_if_detected: the Detector is made with `exit_fn=None`, its public way of deferring the
stop to the loop: a report's stop decision is rank 0's, broadcast to all, so every rank sees
`report.stop` at the same step. The callback then has the Trainer save its normal
`checkpoint-<step>` in `output_dir` and exits with ExitCode.STRAGGLER_STOP (19) once every
rank has saved (nvrx_hf.preemption.StopAfterSave: the same sequence as a preemption stop).
The default `exit_fn` would raise SystemExit inside `step()`, before the Trainer could save.

The wrapper on `forward` and the detector live for one `train()`: made in `on_train_begin`,
removed in `on_train_end` and before a stop's exit. The Trainer has no exception event: a
`train()` that raises leaves `forward` wrapped until the next `train()` of this callback.
"""

import logging
from typing import Any, Dict, Optional

from nvrx_core.config import check
from nvrx_core.exit_codes import ExitCode
from nvrx_core.straggler import Detector, Report, callback_args

from nvrx_hf._compat import TrainerCallback
from nvrx_hf.preemption import StopAfterSave

logger = logging.getLogger("nvrx.hf.straggler")

TIMED_SECTION = "forward"


class NVRxStragglerDetection(TrainerCallback):
    """Straggler detection for `Trainer.train`; see the module docstring.

    Args: nvidia-resiliency-ext's StragglerDetectionCallback's (`nvrx_core.straggler.callback_args`),
    as nvrx_lightning's callback takes them, without `enable_ptl_logging`: report_time_interval,
    calc_relative_gpu_perf, calc_individual_gpu_perf, num_gpu_perf_scores_to_print,
    gpu_relative_perf_threshold, gpu_individual_perf_threshold, stop_if_detected (on a flagged
    straggler the Trainer saves and every rank exits 19), profiling_interval, logger_name (None:
    "nvrx.hf.straggler"); then
        log_scores: add the score summaries to the Trainer's log history (rank 0).
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
        profiling_interval: int = 1,
        logger_name: Optional[str] = logger.name,
        *,
        log_scores: bool = True,
        **straggler_config: Any,
    ):
        check(isinstance(log_scores, bool), "log_scores", log_scores, "must be True or False")
        logger_name = logger.name if logger_name is None else logger_name
        self.config = callback_args.straggler_config(locals(), straggler_config, source=type(self).__name__)
        self.log_scores = log_scores
        self._detector: Optional[Detector] = None
        self._stop: Optional[StopAfterSave] = None
        self._unlogged: Dict[str, float] = {}
        self.last_report: Optional[Report] = None
        """The latest report of the current (or last) `train()` on this rank; complete on rank 0."""
        self.report_count = 0
        """Reports made in the current (or last) `train()`."""

    @property
    def stopped_at_step(self) -> Optional[int]:
        """The global step of a straggler stop in the current (or last) `train()`, if any."""
        return None if self._stop is None else self._stop.step

    # ---- one detector per train()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._close()
        if model is None:
            raise ValueError("NVRxStragglerDetection: the Trainer passed no model to on_train_begin")
        self.last_report, self.report_count, self._unlogged = None, 0, {}
        self._stop = StopAfterSave(int(ExitCode.STRAGGLER_STOP), "straggler stop", logger)
        self._detector = Detector(self.config, exit_fn=None)  # the stop waits for the Trainer's save
        self._detector.wrap_attribute(model, "forward", name=TIMED_SECTION)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._detector is None or self._stop.requested:
            return
        report = self._detector.step()  # every rank, same steps
        if report is None:
            return
        self.last_report, self.report_count = report, self._detector.report_count
        if self.log_scores and report.complete and state.is_world_process_zero:
            self._unlogged = callback_args.score_summaries(report)
        if report.stop:  # rank 0's decision, the same on every rank (the Detector logged it)
            self._stop.request(args, state, control)

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None,
               **kwargs: Any) -> None:
        if not self._unlogged or not state.log_history:
            return
        metrics, self._unlogged = self._unlogged, {}
        state.log_history[-1].update(metrics)  # the entry this on_log is for (Trainer.log appends it first)
        if logs is not None:
            logs.update(metrics)  # callbacks after this one see them too

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._stop is not None:
            self._stop.saved()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._stop is not None:
            self._stop.exit_if_saved(self._close)

    # ---- undo, on every way out

    def _close(self) -> None:
        detector, self._detector = self._detector, None
        if detector is not None:
            detector.close()  # restores the model's forward

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()
        if self._stop is not None:
            self._stop.exit_at_train_end(self._close)

