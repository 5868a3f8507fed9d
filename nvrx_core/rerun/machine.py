"""RerunStateMachine: re-runs a suspicious training step to tell what produced a bad result.

A NaN or a loss spike may come from the data, a transient hiccup or a GPU that now
computes wrong answers. The step is re-run in place from the same RNG state and
microbatches: a different result means a transient error; the same result means either
the data or this device, so the job checkpoints and exits 16 to be resumed on another
device, where a different result convicts the first device (persistent error) and the
same result clears it (application/data problem).

Training-loop protocol (Megatron-LM's names)::

    while machine.should_run_forward_backward(data_iterator):
        optimizer.zero_grad()
        loss = forward_backward(next(data_iterator))
        machine.validate_loss(loss)            # or validate_result(...) for any value
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()
    if should_checkpoint: save({..., "rerun": machine.state_dict(data_iterator)})
    if should_exit: sys.exit(exit_code)
    optimizer.step()

The states and their transitions are the table in `states.py`; each protocol call turns
into one event, agreed by all ranks with one integer all-reduce. state_dict() and
load_state_dict() are `checkpoint_state.py`'s.
"""

import functools
import logging
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from nvrx_core import dist_env
from nvrx_core import events as ev
from nvrx_core.events import EventLog
from nvrx_core.exit_codes import ExitCode
from nvrx_core.rerun import report
from nvrx_core.rerun.adapters import DeviceIdentity, RngStateAdapter, StateAdapter, local_device_identity
from nvrx_core.rerun.checkpoint_state import CheckpointState
from nvrx_core.rerun.checks import check_validation_arguments, reject_non_finite
from nvrx_core.rerun.collective import CollectiveVote
from nvrx_core.rerun.config import RerunConfig, RerunMode
from nvrx_core.rerun.data import RerunDataIterator, as_rerun_iterators
from nvrx_core.rerun.injection import RerunErrorInjector
from nvrx_core.rerun.persist import FailedCall
from nvrx_core.rerun.run import RunChecks, as_flag
from nvrx_core.rerun.spiky import SpikyLossDetector
from nvrx_core.rerun.states import (
    EXIT_REQUESTS, RerunEvent, RerunState, next_state, vote_code, voted_event,
)
from nvrx_core.rerun.stats import DeterminismStats, combine_ranks, relative_difference

logger = logging.getLogger("nvrx.rerun")

S, E = RerunState, RerunEvent
ComparisonFunc = Callable[[Any, Any], Any]


class RerunValidationError(RuntimeError):
    """A fatal check rejected a result while reruns are disabled (Megatron-LM raises here too)."""


class RerunStateMachine(CheckpointState):
    def __init__(
        self,
        config: RerunConfig,
        *,
        process_group: Optional[Any] = None,
        device: Optional[torch.device] = None,
        device_identity: Optional[DeviceIdentity] = None,
        state_adapters: Optional[Sequence[StateAdapter]] = None,
        extra_state_adapters: Sequence[StateAdapter] = (),
        events: Optional[EventLog] = None,
        injector: Optional[RerunErrorInjector] = None,
        clock: Callable[[], float] = time.time,
        tensor_ops_on_cpu: bool = False,
    ):
        """`device`: where the step computes (default: the process group's device, CPU for gloo).
        `device_identity`: overrides the detected one (a test simulating "another GPU").
        `state_adapters`: what a rerun restores (default: every RNG); add CallbackStateAdapters for more.
        `extra_state_adapters`: restored after those (e.g. Megatron's state_save_func / state_restore_func
        pair), keeping the default RNG adapter, whose device is known only once the group exists.
        `tensor_ops_on_cpu`: check CPU tensors the way accelerator tensors are checked (see checks.py).
        """
        self.config = config
        self.mode: RerunMode = config.rerun_mode
        self.state = S.NOT_RUNNING_YET
        self.current_iteration = 0
        """Steps begun since training started (travels in checkpoints): the iteration in logs."""
        self.same_device_restarts = 0
        self.last_determinism_report: Optional[dict] = None
        self._vote = CollectiveVote(process_group, device)
        self._identity = device_identity
        self._state_adapters = list(state_adapters) if state_adapters is not None else None
        self._extra_adapters = list(extra_state_adapters)
        self._events = events if events is not None else EventLog.from_env("rerun")
        self._reporter = report.RejectionReporter(
            report.RejectedResultsLog(config.result_rejected_tracker_filename), self._events, clock
        )
        self._injector = injector or RerunErrorInjector(config.error_injection_rate, config.error_injection_type)
        self._tensor_ops_on_cpu = tensor_ops_on_cpu
        self._reject_non_finite = functools.partial(reject_non_finite, tensor_ops_on_cpu=tensor_ops_on_cpu)
        self._spiky = self._new_spiky_detector()
        self._stats = DeterminismStats()
        self._run = RunChecks()
        self._failed: Optional[FailedCall] = None
        self._saved: Optional[List[Any]] = None
        self._iterators: List[Optional[RerunDataIterator]] = []
        self._loaded_iterator_states: Optional[List[Optional[dict]]] = None

    # ----------------------------------------------------------------- protocol
    def should_run_forward_backward(self, data_iterator: Any = None) -> bool:
        """True: run the step's forward/backward (again). False: leave the loop."""
        if self.state is S.INITIAL_RUN:
            return self._end_initial_run()
        if self.state is S.RERUNNING_IN_PLACE:
            return self._end_rerun_in_place()
        if self.state is S.RERUNNING_FROM_CHECKPOINT:
            return self._end_rerun_from_checkpoint()
        if self.state is S.PENDING_RERUN_FROM_CHECKPOINT:
            return self._begin_rerun_from_checkpoint(self._as_iterators(data_iterator))
        return self._begin_step(data_iterator)

    def validate_result(
        self,
        result: Any,
        rejection_func: Callable[[Any], Any],
        message: str = "unexpected result",
        comparison_func: Optional[ComparisonFunc] = None,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> None:
        """Check `result` inside the step; `rejection_func(result)` is truthy for a bad result.

        It may return a device tensor: the machine reads all of a step's flags back at once.
        `comparison_func(initial, rerun)` (default: relative difference) above `tolerance`
        means the rerun did not reproduce the result. A fatal check stops training (exit 17)
        rather than go on with a result that reproduced elsewhere or a transient error.
        Keep `result` unmodified until the step ends: the machine holds a reference.
        """
        check_validation_arguments(rejection_func, message, comparison_func, tolerance, fatal)
        if self.mode is RerunMode.DISABLED:
            if bool(as_flag(rejection_func(result))):
                self._reject_while_disabled(result, message, fatal)
            return
        compare = comparison_func or relative_difference
        if self.state is S.INITIAL_RUN:
            keep_initial = self.mode is RerunMode.REPORT_DETERMINISM_STATS
            flag = None if keep_initial else rejection_func(result)
            self._run.record(message, result, flag, fatal, keep_initial, self._injector)
        elif self.state is S.RERUNNING_IN_PLACE and self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self._stats.add(message, compare(self._run.initial_result(message), result))
        elif self.state in (S.RERUNNING_IN_PLACE, S.RERUNNING_FROM_CHECKPOINT):
            self._run.compare(self._failed, message, result, compare, tolerance, self._injector,
                              in_place=self.state is S.RERUNNING_IN_PLACE)
        else:
            raise RuntimeError(
                f"validate_result({message!r}) called in state {self.state.value!r}: call it inside "
                "the `while should_run_forward_backward(...)` loop"
            )

    def should_checkpoint_and_exit(self) -> Tuple[bool, bool, ExitCode]:
        """(should_checkpoint, should_exit, exit_code): ask after the loop, before the optimizer step."""
        try:
            return EXIT_REQUESTS[self.state]
        except KeyError:
            raise RuntimeError(
                f"should_checkpoint_and_exit() called in state {self.state.value!r}: call it after "
                "should_run_forward_backward() returned False"
            ) from None

    def validate_loss(self, loss: Any, tolerance: float = 0.0) -> None:
        """The configured loss checks: NaN/Inf (fatal) and spiky loss (not fatal)."""
        if self.config.check_for_nan_in_loss:
            self.validate_result(loss, self._reject_non_finite, "NaN/Inf loss", tolerance=tolerance, fatal=True)
        if self.config.check_for_spiky_loss:
            self.validate_result(loss, self.is_spiky_loss, "spiky loss", tolerance=tolerance, fatal=False)

    def is_spiky_loss(self, loss: Any) -> Any:
        """Rejection function: loss > spiky_loss_factor x the median of recent accepted losses."""
        return self._spiky(loss)

    # ------------------------------------------------------------- step phases
    def _begin_step(self, data_iterator: Any) -> bool:
        if self.mode is RerunMode.DISABLED:
            self._apply(E.BEGIN_STEP)
            self.current_iteration += 1
            return True
        iterators = self._as_iterators(data_iterator)
        self._apply(E.BEGIN_STEP)
        self.current_iteration += 1
        self._iterators = iterators
        if self._loaded_iterator_states is not None:
            self._load_iterator_states(self._iterators)
        for it in self._live_iterators():
            it.advance()
        self._saved = [adapter.capture() for adapter in self._adapters]
        self._run = RunChecks()
        return True

    def _end_initial_run(self) -> bool:
        if self.mode is RerunMode.DISABLED:
            self._apply(E.ALL_ACCEPTED)
            return False
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self._apply(E.RERUN_REQUESTED)
            self._start_rerun()
            return True
        event = voted_event(S.INITIAL_RUN, self._vote.max(self._run.any_rejected()))
        if event is E.ALL_ACCEPTED:
            self._apply(event)
            self._run = RunChecks()
            return False
        self._failed = self._run.first_rejected(self.current_iteration)
        if self._failed is not None:
            injected = self._failed.injected
            self._record(report.INITIAL_RUN, self._failed, self._failed.initial_result,
                         detail=f"injected {injected.value}" if injected else "rejected; rerunning in place")
        self._apply(event)
        self._start_rerun()
        return True

    def _end_rerun_in_place(self) -> bool:
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self._stats.end_step()
            self._apply(E.STATS_RECORDED)
            interval = self.config.determinism_stats_interval
            if interval and self.current_iteration % interval == 0:
                self.report_determinism_stats()
            return False
        local = self._run.outcome(self._failed, in_place=True) if self._failed else None
        event = voted_event(S.RERUNNING_IN_PLACE, self._vote.max(vote_code(S.RERUNNING_IN_PLACE, local)))
        failed = self._failed
        if local is E.REPRODUCED:
            failed.suspicious_device = self.identity
            self._record(report.FIRST_RERUN_REPRODUCIBLE, failed, self._run.rerun_result,
                         detail=f"reproduced on {self.identity}; needs a rerun on another device")
        elif local is not None:
            self._record(report.FIRST_RERUN_NOT_REPRODUCIBLE, failed, self._run.rerun_result,
                         diagnosis="transient_error",
                         detail=f"did not reproduce on the same device ({self.identity}): transient error")
        self._apply(event)
        if event is not E.REPRODUCED or local is not E.REPRODUCED:
            self._failed = None  # nothing left for this rank to follow up
        if event is E.REPRODUCED:
            self._restore_step_start()  # the exit checkpoint must hold the state before the step
        return False

    def _begin_rerun_from_checkpoint(self, iterators: List[Optional[RerunDataIterator]]) -> bool:
        self._iterators = iterators
        self._load_iterator_states(iterators)
        code = 0
        failed = self._failed
        if failed is not None and failed.suspicious_device.key == self.identity.key:
            code = 2 if self.same_device_restarts >= self.config.max_same_device_restarts else 1
        event = voted_event(S.PENDING_RERUN_FROM_CHECKPOINT, self._vote.max(code))
        if event is E.BEGIN_STEP:
            self._apply(event)
            self._restore_step_start()
            self._run = RunChecks()
            return True
        self.same_device_restarts += 1
        if code == 1:
            self._record(report.SAME_DEVICE_AGAIN, failed, failed.initial_result,
                         detail=f"resumed on the suspicious device {self.identity} again "
                                f"({self.same_device_restarts} of {self.config.max_same_device_restarts}); "
                                "checkpointing and exiting to be placed elsewhere")
        elif code == 2:
            self._record(report.SAME_DEVICE_GAVE_UP, failed, failed.initial_result, diagnosis=report.UNDETERMINED,
                         detail=f"the job came back on the suspicious device {self.identity} "
                                f"{self.same_device_restarts} times; a persistent fault and an application/data "
                                f"problem cannot be told apart: exclude host {self.identity.host} "
                                f"(device {self.identity.device}) from the allocation and resume")
        self._apply(event)
        return False

    def _end_rerun_from_checkpoint(self) -> bool:
        local = self._run.outcome(self._failed, in_place=False) if self._failed else None
        code = self._vote.max(vote_code(S.RERUNNING_FROM_CHECKPOINT, local))
        event = voted_event(S.RERUNNING_FROM_CHECKPOINT, code)
        failed = self._failed
        if local is E.PERSISTENT_ERROR:
            self._record(report.SECOND_RERUN_NOT_REPRODUCIBLE, failed, self._run.rerun_result,
                         diagnosis="persistent_error",
                         detail=f"differs on {self.identity}: persistent fault on {failed.suspicious_device}; "
                                "drain that device")
        elif local is not None:
            self._record(report.SECOND_RERUN_REPRODUCIBLE, failed, self._run.rerun_result,
                         diagnosis="correct_result",
                         detail=f"reproduced on {failed.suspicious_device} and {self.identity}: application/data "
                                f"problem at iteration {failed.iteration} (skip its data)")
        self._failed = None
        self.same_device_restarts = 0
        self._apply(event)
        return False

    # --------------------------------------------------------------- helpers
    def _start_rerun(self) -> None:
        self._restore_step_start()
        self._run.start_rerun()

    def _restore_step_start(self) -> None:
        for adapter, snapshot in zip(self._adapters, self._saved):
            adapter.restore(snapshot)
        for it in self._live_iterators():
            it.rewind()

    def _apply(self, event: RerunEvent) -> None:
        before = self.state
        hint = ""
        if before in EXIT_REQUESTS and before is not S.NOT_RUNNING_YET:
            hint = f"should_checkpoint_and_exit() asked to exit with {EXIT_REQUESTS[before][2].name}"
        self.state = next_state(before, event, hint)
        logger.debug("rerun: iteration %d: %s --%s--> %s", self.current_iteration, before.value, event.value, self.state.value)
        if self.state is not before and self.state in EXIT_REQUESTS and self.state is not S.NOT_RUNNING_YET:
            checkpoint, _, code = EXIT_REQUESTS[self.state]
            logger.error("rerun: iteration %d: %s; exiting with %s (%d)%s", self.current_iteration,
                         event.value, code.name, int(code), " after a checkpoint" if checkpoint else "")
            self._events.emit(ev.RERUN_EXIT_REQUESTED, rank=self._rank, iteration=self.current_iteration,
                              event=event.value, exit_code=int(code), checkpoint=checkpoint)

    def _as_iterators(self, data_iterator: Any) -> List[Optional[RerunDataIterator]]:
        return as_rerun_iterators(data_iterator, f"rerun_mode={self.mode.value}")

    def _live_iterators(self) -> List[RerunDataIterator]:
        return [it for it in self._iterators if it is not None]

    def _new_spiky_detector(self) -> SpikyLossDetector:
        c = self.config
        return SpikyLossDetector(c.spiky_loss_factor, c.spiky_loss_window, c.spiky_loss_warmup,
                                 c.spiky_loss_min_samples, self._tensor_ops_on_cpu)

    @property
    def _adapters(self) -> List[StateAdapter]:
        """Resolved at first use: the default RNG adapter needs the device, known once the group exists."""
        if self._state_adapters is None:
            self._state_adapters = [RngStateAdapter(self._vote.device)]
        return self._state_adapters + self._extra_adapters

    @property
    def diagnoses(self) -> List[report.RejectedResult]:
        """This rank's diagnoses so far (also in the rejected-results log and the event log)."""
        return self._reporter.diagnoses

    @property
    def identity(self) -> DeviceIdentity:
        if self._identity is None:
            self._identity = local_device_identity(self._vote.device)
        return self._identity

    @property
    def _rank(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return dist_env.rank()

    def _record(self, status: str, failed: FailedCall, result: Any, diagnosis: Optional[str] = None, detail: str = "") -> None:
        self._reporter.record(
            status, iteration=failed.iteration, rank=self._rank, host=self.identity.host, device=str(self.identity),
            message=failed.message, result=result, diagnosis=diagnosis, detail=detail,
            injected=failed.injected.value if failed.injected else None,
            suspect_device=str(failed.suspicious_device) if failed.suspicious_device else None,
        )

    def _reject_while_disabled(self, result: Any, message: str, fatal: bool) -> None:
        failed = FailedCall(self.current_iteration, message, 0, fatal, result)
        self._record(report.RERUN_DISABLED, failed, result)
        text = (f"rank {self._rank}, {self.identity}, iteration {self.current_iteration}: result "
                f"{report.describe_result(result)} rejected ({message}); rerun_mode=disabled, so it is not re-checked")
        if fatal:
            raise RerunValidationError(text)

    # ---------------------------------------------------------------- stats
    def report_determinism_stats(self) -> Optional[dict]:
        """Collective: gathers every rank's relative differences; the summary on rank 0, else None."""
        gathered = self._vote.gather_json(self._stats.take())
        if gathered is None:
            return None
        summary = combine_ranks(gathered, self.current_iteration)
        self.last_determinism_report = summary
        for message, s in summary["calls"].items():
            logger.info("rerun determinism stats, iteration %d, %r: %s", self.current_iteration, message, s)
        self._events.emit(ev.RERUN_DETERMINISM_STATS, rank=self._rank, **summary)
        return summary
