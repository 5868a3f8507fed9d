"""NVRxPreemption: a preemption signal to any one rank stops every rank at the same global
step, saves a checkpoint and exits with ExitCode.PREEMPTED (18), "requeue me".

    trainer = Trainer(callbacks=[NVRxPreemption(), ModelCheckpoint(dirpath="ckpt")])
    trainer.fit(model, ckpt_path="last")      # the requeued job resumes from the saved one

Why the callback holds the signal itself while training runs: Lightning 2.6's SIGTERM
handler assumes every rank is signalled. With more than one rank it runs a broadcast from
inside the handler, which the other ranks do not pair with that call, and the loops then
stop the signalled rank alone (SIGTERMException). Sent to one rank, as when a scheduler
drains one node first or a launcher signals one worker, the job deadlocks (2.6.6, gloo:
both ranks of a 2-rank job stay blocked at the step where the signal arrived).

So the configured signals are claimed from nvrx_core's signal registry (the one owner of
signal dispositions in our code) once the Trainer has installed its own handlers, at
on_sanity_check_start or on_train_start, whichever comes first. The registry keeps
Lightning's handler as the disposition to give back, and the claim is released in
on_train_end, on_exception and teardown, all of which run before the Trainer restores the
handlers from before `fit`; so after `fit` every signal's handler is what it was. Outside
training (setup, checkpoint restore) Lightning's handling is untouched.

The handler only records the signal (nvrx_core.preemption.DistributedSignalHandler: no IO,
no collective). At the end of a training batch whose optimizer step reached a multiple of
check_every_n_steps, the ranks agree with one all-reduce; on an agreed stop every rank
sets `trainer.should_stop`, saves through `trainer.save_checkpoint` and raises
SystemExit(exit_code) once the checkpoint is written on every rank (save_before_exit). The
exit goes through Lightning's exception path: `on_exception` hooks run, the Trainer tears
down, the process exits with the code. Nothing on that path communicates.

The checkpoint is `<dir>/last-preempted-step=<global_step>.ckpt`, where <dir> is `dirpath`,
else the first ModelCheckpoint's dirpath, else `<default_root_dir>/checkpoints`. Its name
starts with "last", so `fit(ckpt_path="last")` picks it (by modification time) when a
ModelCheckpoint uses that directory; otherwise pass its path.
"""

import logging
import os
from typing import Any, List, Optional, Sequence, Union

from nvrx_core.config import check
from nvrx_core.exit_codes import ExitCode
from nvrx_core.preemption import DistributedSignalHandler, PreemptionConfig, signal_names

from nvrx_lightning._compat import Callback

logger = logging.getLogger("nvrx.lightning.preemption")

CHECKPOINT_PREFIX = "last-preempted"


class NVRxPreemption(Callback):
    """Stop every rank together on a preemption signal, checkpoint, exit `exit_code`.

    Args:
        signals: signal names (or numbers) that mean "you are being preempted"; Slurm sends
            SIGTERM, or the signal chosen with `--signal`.
        check_every_n_steps: ranks agree on a received signal when the global step reaches
            a multiple of this (one tiny all-reduce); the reaction time is at most that
            many steps.
        exit_code: the process exit status after the checkpoint (18, ExitCode.PREEMPTED);
            ft_launcher stops instead of restarting on it.
        dirpath: directory for the checkpoint; default: the ModelCheckpoint's dirpath, else
            `<default_root_dir>/checkpoints`.
    """

    def __init__(self, signals: Sequence[Union[str, int]] = ("SIGTERM",), check_every_n_steps: int = 10,
                 exit_code: int = int(ExitCode.PREEMPTED), dirpath: Optional[Union[str, os.PathLike]] = None):
        names = signal_names(signals)
        self.config = PreemptionConfig(signals=names, check_every_n_steps=check_every_n_steps, exit_code=exit_code)
        check(dirpath is None or isinstance(dirpath, (str, os.PathLike)), "dirpath", dirpath,
              "must be a directory path or None")
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self._handler: Optional[DistributedSignalHandler] = None
        self._checkpoint_dir: Optional[str] = None
        self._last_step: Optional[int] = None
        self._received: List[int] = []
        self.stopped_at_step: Optional[int] = None
        """The global step of the agreed stop, once there was one."""

    @property
    def received(self) -> List[int]:
        """Signal numbers this rank received during the current (or last) fit."""
        return list(self._handler.received) if self._handler is not None else list(self._received)

    # ---- holding the signals while training runs

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._received, self.stopped_at_step = [], None

    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        self._hold()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._hold()
        self._checkpoint_dir = checkpoint_dir(trainer, self.dirpath)
        self._last_step = trainer.global_step

    def _hold(self) -> None:
        """Claim the signals (a fresh handler per fit: no agreement carries over). The
        Trainer installed its handlers just before; the registry restores them on release."""
        if self._handler is not None:
            return
        self._handler = DistributedSignalHandler(self.config).install()
        logger.debug("holding %s while training runs", ", ".join(self.config.signals))

    def _release(self) -> None:
        handler, self._handler = self._handler, None
        if handler is not None:
            self._received = list(handler.received)
            handler.release()

    # ---- the agreed decision, on the clean path

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self._handler is None or step == self._last_step:
            return  # no optimizer step in this batch (accumulation): every rank skips alike
        self._last_step = step
        if not self._handler.should_stop(step):
            return
        trainer.should_stop = True
        self.stopped_at_step = step
        path = os.path.join(self._checkpoint_dir, f"{CHECKPOINT_PREFIX}-step={step}.ckpt")
        logger.warning("preemption agreed at global step %d: saving %s, then exiting with %d",
                       step, path, self.config.exit_code)
        save_before_exit(trainer, path)
        self._handler.exit_preempted()  # SystemExit(exit_code); on_exception gives the signals back

    # ---- undo, on every way out

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._release()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._release()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._release()


def save_before_exit(trainer: Any, path: str) -> None:
    """Save a full checkpoint on every rank (the strategy picks the writer), wait until an
    asynchronous CheckpointIO has written it (its teardown waits, and its next save starts
    it again), then meet at a barrier. No rank leaves before the checkpoint exists, so a
    launcher that stops the other ranks as soon as one exits cannot cut the write short.
    Clean path only: every rank calls it at the same agreed step."""
    trainer.save_checkpoint(path, weights_only=False)
    trainer.strategy.checkpoint_io.teardown()
    trainer.strategy.barrier("nvrx_lightning.save_before_exit")


def checkpoint_dir(trainer: Any, dirpath: Optional[str]) -> str:
    """The directory for a stop's checkpoint: `dirpath`, else the first ModelCheckpoint's
    (resolved in its setup, the same on every rank), else `<default_root_dir>/checkpoints`.
    Called in on_train_start, so nothing is resolved on the way out."""
    if dirpath:
        return dirpath
    callback_dir = getattr(trainer.checkpoint_callback, "dirpath", None)
    if callback_dir:
        return os.fspath(callback_dir)
    return os.path.join(trainer.default_root_dir, "checkpoints")
