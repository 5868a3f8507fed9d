"""NVRxPreemption: a preemption signal to any one rank stops every rank of a Hugging Face
`Trainer.train` at the same global step; the Trainer saves its normal checkpoint, then every
process exits with ExitCode.PREEMPTED (18), "requeue me".

    trainer = Trainer(model, args, train_dataset=..., callbacks=[NVRxPreemption()])
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir))  # the requeued job

The mechanism is nvrx_core.preemption's DistributedSignalHandler: its handler only records
the signal (no IO, no collective), and every `check_every_n_steps` optimizer steps the ranks
agree with one tiny all-reduce, in `on_step_end`, which every rank reaches at the same global
steps (gradient accumulation's micro-batches do not reach it). A scheduler may signal one node
first; a rank that stopped alone would leave the others blocked in their next collective.

The callback maps the rest onto the Trainer's own flow instead of saving by itself (it is not
handed the Trainer): on the agreed step it sets `control.should_save` and
`control.should_training_stop`, so the Trainer writes `checkpoint-<step>` in `output_dir` as
it writes any other (model, optimizer, scheduler, RNG states, trainer_state.json) and then
leaves its loop. See `StopAfterSave` for where the exit happens and why there.

The signals are claimed from nvrx_core's signal registry (the one owner of signal
dispositions) in `on_train_begin`, after the checkpoint was loaded, and given back on the way
out: before the stop's exit, and in `on_train_end`. The Trainer has no exception event: a
`train()` that raises leaves the claim held (the handler only records; a second `train()` in
the same process takes a fresh claim after the previous one is released by that call's own
`on_train_begin`).
"""

import logging
from typing import Any, Callable, List, Optional, Sequence, Union

from nvrx_core.collectives import Collectives
from nvrx_core.exit_codes import ExitCode
from nvrx_core.preemption import DistributedSignalHandler, PreemptionConfig, signal_names

from nvrx_hf._compat import TrainerCallback

logger = logging.getLogger("nvrx.hf.preemption")


class StopAfterSave:
    """One agreed stop of a Trainer run: make the Trainer save, wait for every rank, exit.

    The order of events after `on_step_end` has set the two flags is the Trainer's:
    `_maybe_log_save_evaluate` saves and calls every callback's `on_save`, the loops break on
    `should_training_stop`, then `on_epoch_end`, later `on_train_end`. `saved()` (from
    `on_save`) meets the other ranks in one all-reduce, so no rank leaves before every rank
    wrote its share (rank 0 the model and optimizer, each rank its RNG state), and a launcher
    that stops the job as soon as one worker exits cannot cut a write short. The exit is
    raised at the next `on_epoch_end` rather than in `on_save` itself: by then every callback's
    `on_save` has run whatever the order of the callback list (NVRxFaultTolerance closes its
    'checkpointing' section there), and `on_train_end`, where NVRxFaultTolerance would write
    the finished flag, has not. Clean path only: every rank reaches these events at the same
    step, so the collective pairs up.
    """

    def __init__(self, exit_code: int, what: str, log: logging.Logger):
        self.exit_code = exit_code
        self.what = what
        self.step: Optional[int] = None
        self._saved = False
        self._log = log

    @property
    def requested(self) -> bool:
        return self.step is not None

    def request(self, args: Any, state: Any, control: Any) -> None:
        """At `on_step_end` of the agreed step, on every rank."""
        if self.requested:
            return
        self.step = state.global_step
        control.should_save = True
        control.should_training_stop = True
        if getattr(args, "save_strategy", None) == "best":  # SaveStrategy is a str enum
            # An evaluation at this step would set should_save to "is this a new best?".
            control.should_evaluate = False
        self._log.warning("%s at global step %d: the Trainer saves checkpoint-%d, then every rank exits with %d",
                          self.what, self.step, self.step, self.exit_code)

    def saved(self) -> None:
        """At `on_save`: the first save after the request is the stop's; wait for every rank."""
        if self.requested and not self._saved:
            Collectives().all_reduce_max([1])  # a barrier; the identity in a world of one
            self._saved = True

    def exit_if_saved(self, leave: Callable[[], None]) -> None:
        """At `on_epoch_end`: once the stop's checkpoint is on disk on every rank, `leave()`
        undoes what the callback installed and raises SystemExit(exit_code)."""
        if self._saved:
            leave()
            raise SystemExit(self.exit_code)  # reached only if leave() did not raise

    def exit_at_train_end(self, leave: Callable[[], None]) -> None:
        """At `on_train_end`: a requested stop never leaves `train()` normally. Reached only if
        another callback cleared the save or the loop's stop flag; every rank got here alike."""
        if not self.requested:
            return
        if not self._saved:
            self._log.error("the %s at global step %d was agreed but the Trainer did not save: exiting without "
                            "that checkpoint (the next run resumes from the previous one)", self.what, self.step)
        self._saved = True
        self.exit_if_saved(leave)


class NVRxPreemption(TrainerCallback):
    """Stop every rank together on a preemption signal, let the Trainer save, exit `exit_code`.

    Args:
        signals: signal names (or numbers) that mean "you are being preempted"; Slurm sends
            SIGTERM, or the signal chosen with `--signal`.
        check_every_n_steps: the ranks agree on a received signal when the global step
            reaches a multiple of this (one tiny all-reduce); the reaction time is at most
            that many optimizer steps.
        exit_code: the process exit status after the checkpoint (18, ExitCode.PREEMPTED);
            ft_launcher ends the job instead of restarting it.
    """

    def __init__(self, signals: Sequence[Union[str, int]] = ("SIGTERM",), check_every_n_steps: int = 10,
                 exit_code: int = int(ExitCode.PREEMPTED)):
        names = signal_names(signals)
        self.config = PreemptionConfig(signals=names, check_every_n_steps=check_every_n_steps, exit_code=exit_code)
        self._handler: Optional[DistributedSignalHandler] = None
        self._stop: Optional[StopAfterSave] = None

    @property
    def received(self) -> List[int]:
        """Signal numbers this rank received during the current (or last) `train()`."""
        return [] if self._handler is None else list(self._handler.received)

    @property
    def stopped_at_step(self) -> Optional[int]:
        """The global step of the agreed stop in the current (or last) `train()`, if any."""
        return None if self._stop is None else self._stop.step

    # ---- holding the signals while training runs

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A fresh handler per `train()`: no agreement carries over."""
        self._release()
        self._handler = None
        self._stop = StopAfterSave(self.config.exit_code, "preemption stop", logger)
        self._handler = DistributedSignalHandler(self.config).install()
        logger.debug("holding %s while training runs", ", ".join(self.config.signals))

    def _release(self) -> None:
        if self._handler is not None:
            self._handler.release()  # idempotent; the handler keeps what it received

    def _leave(self) -> None:
        self._release()
        self._handler.exit_preempted()  # SystemExit(config.exit_code)

    # ---- the agreed decision, on the clean path

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._handler is None or not self._handler.installed or self._stop.requested:
            return
        if self._handler.should_stop(state.global_step):  # every rank, same steps: the collective pairs
            self._stop.request(args, state, control)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._stop is not None:
            self._stop.saved()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._stop is not None:
            self._stop.exit_if_saved(self._leave)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._release()
        if self._stop is not None:
            self._stop.exit_at_train_end(self._leave)
