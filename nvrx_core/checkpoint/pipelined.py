"""The save lifecycle every checkpointer shares, written once over a SavePipeline.

AsyncCheckpointer (numbered steps under one root, all ranks), LocalCheckpointManager
(node-local steps, replicated to peers) and PathCheckpointer (paths the caller names, one
process) differ in where a save's files go, how a written save is committed (their settle
hooks) and what finalize() reports for it: a step or a path. Everything else was the same
code three times, and a fix made in one copy missed the others: PipelinedSaves owns it.

- start: wait for the oldest save when max_pending_saves are in flight, then stage;
- confirm staging (wait_staged), collect results (finalize / finish): every finished save's
  verdict is taken, failures become `checkpoint_failed` events, and the first failure is
  raised (the others logged) unless fail_on_save_error is False;
- abort(timeout): stop the saves in flight, delete this rank's partial output, one
  `checkpoint_aborted` event each;
- close, idempotent; and at interpreter exit for an owner that never called it, through
  nvrx_core.teardown (see pipeline.py for why it must run while the interpreter is whole).
"""

import logging
import shutil
import time
import weakref
from typing import Any, Callable, List, Optional

from nvrx_core.checkpoint.config import CheckpointConfig
from nvrx_core.checkpoint.errors import CheckpointError, CheckpointSaveError, SnapshotModifiedError
from nvrx_core.checkpoint.pipeline import PendingSave, SavePipeline, SettleHook, remove_rank_files
from nvrx_core.events import (CHECKPOINT_ABORTED, CHECKPOINT_FAILED, CHECKPOINT_SKIPPED,
                              EventLog)
from nvrx_core.teardown import finish_before_exit

logger = logging.getLogger("nvrx.checkpoint")


class PipelinedSaves:
    """One checkpointer's saves: started, confirmed, collected, aborted and closed.

    Used by the training thread only (as SavePipeline). What differs between owners comes in
    as arguments: `settle` commits a written save (on the worker). A save's `target` is what
    finalize() reports for it, its step by default or the path it is saved to; with
    `target_field` ("path") events carry it under that name and errors name it ("checkpoint
    save to <path> failed"), else the step ("<noun> save of step 5 failed"). `event_fields`
    go into every event (the local tier's `tier`). `shared_directories`: other ranks write
    into the same partial directory, so an abort removes only this rank's files. `on_close`
    releases what the owner holds besides the pipeline.
    """

    def __init__(self, config: CheckpointConfig, rank: int, *, settle: SettleHook,
                 events: EventLog, clock: Callable[[], float] = time.monotonic,
                 noun: str = "checkpoint", target_field: Optional[str] = None,
                 event_fields: Optional[dict] = None, shared_directories: bool = False,
                 on_close: Optional[Callable[[], None]] = None):
        self.config = config
        self.pipeline = SavePipeline(config, rank, clock)
        self._settle = settle
        self._events = events
        self._noun = noun
        self._target_field = target_field
        self._event_fields = dict(event_fields or {})
        self._shared_directories = shared_directories
        self._on_close = on_close
        self._exit_hook = False

    @property
    def pending_targets(self) -> List[Any]:
        """What finalize() will report for the saves in flight, oldest first."""
        return [self.pipeline.pending[g].target for g in sorted(self.pipeline.pending)]

    def start(self, state: Any, step: int, directory_for: Callable[[int], str],
              target: Any = None) -> PendingSave:
        """Make room (finishing the oldest saves while max_pending_saves are in flight, raising
        their failures), then stage `state` for writing into `directory_for(generation)`."""
        over = len(self.pipeline.pending) - self.config.max_pending_saves + 1
        self.finish(max(0, over))
        pending = self.pipeline.start(state, step, directory_for, self._settle, target=target)
        if not self._exit_hook:
            # After the first start: the writer pool exists, so concurrent.futures registered
            # its own exit hook before ours, and ours (run first) may still use the pool.
            self._exit_hook = finish_before_exit(_close_at_exit, weakref.ref(self))
        return pending

    def wait_staged(self) -> None:
        """Confirm every overlapped copy, waiting for them (see AsyncCheckpointer.wait_staged)."""
        self.pipeline.confirm_staged(block=True)

    def finalize(self, blocking: bool = False) -> List[Any]:
        """Targets committed since the last call, oldest first; blocking: wait for all."""
        return self.finish(len(self.pipeline.pending) if blocking else 0)

    def finish(self, block_first: int) -> List[Any]:
        """Collect the finished saves, waiting for the oldest `block_first` of them. Every
        verdict is taken before the first failure is raised, so none is lost to it."""
        committed, errors = [], []
        for pending in self.pipeline.take_finished(block_first):
            if pending.result.ok:
                committed.append(pending.target)
                continue
            error = self._failed(pending)
            if error is not None:
                errors.append(error)
        for error in errors[1:]:
            logger.error("%s", error)
        if errors:
            raise errors[0]
        return committed

    def abort(self, timeout: Optional[float] = None) -> List[int]:
        """Stop every save in flight and delete this rank's partial output; their steps.
        A save already committed when the cancellation was seen is kept (it is complete)."""
        aborted = []
        for pending in self.pipeline.abort_all(timeout):
            if pending.result is not None and pending.result.ok:
                continue
            remove_rank_files(pending.directory, pending.rank)
            if not self._shared_directories:
                shutil.rmtree(pending.directory, ignore_errors=True)
            aborted.append(pending.step)
            self._emit(CHECKPOINT_ABORTED, pending)
        return aborted

    def skipped(self, step: int, reason: str) -> None:
        """A committed checkpoint that a load passed over (corrupt or partial)."""
        logger.warning("skipping checkpoint step %d: %s", step, reason)
        self._events.emit(CHECKPOINT_SKIPPED, step=step, reason=reason, **self._event_fields)

    def close(self) -> None:
        """Wait for the saves in flight (raising a failure as finalize does), then stop the
        background threads and release the owner's resources. A second call does nothing."""
        try:
            self.finalize(blocking=True)
        finally:
            self.pipeline.close()
            if self._on_close is not None:
                self._on_close()

    def close_at_exit(self) -> None:
        """The exit hook's work for an owner that never called close(): the same close,
        with its failures logged (nothing is left to raise them to)."""
        if not self.pipeline.started:
            return
        self.pipeline.poll()
        steps = sorted(p.step for p in self.pipeline.pending.values() if p.result is None)
        if steps:
            logger.warning("checkpointer of rank %d not closed before the interpreter exits: "
                           "finishing the saves of steps %s first (a failure is logged, not "
                           "raised: call close() to handle it)", self.pipeline.rank, steps)
        try:
            self.close()
        except Exception as e:
            logger.error("closing the checkpointer at interpreter exit: %s", e)

    def _failed(self, pending: PendingSave) -> Optional[BaseException]:
        """Report a failed save; the error to raise, or None."""
        error = pending.result.error
        self._emit(CHECKPOINT_FAILED, pending, error=repr(error))
        if isinstance(error, SnapshotModifiedError):
            return None   # raised in the training thread already, when the confirmation found it
        where = (f"to {pending.target}" if self._target_field else f"of step {pending.step}")
        message = f"{self._noun} save {where} failed: {_reason(error)}"
        if not self.config.fail_on_save_error:
            logger.error("%s (fail_on_save_error=False: training continues; what was committed "
                         "before is intact)", message)
            return None
        failure = CheckpointSaveError(message)
        failure.__cause__ = error
        return failure

    def _emit(self, kind: str, pending: PendingSave, **fields: Any) -> None:
        if self._target_field:
            fields[self._target_field] = pending.target
        self._events.emit(kind, step=pending.step, generation=pending.generation,
                          **self._event_fields, **fields)


def _reason(error: BaseException) -> str:
    """Our own errors say what happened; others get their type too, and keep their str():
    an OSError's names the file (its repr does not)."""
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def _close_at_exit(ref: "weakref.ref[PipelinedSaves]") -> None:
    saves = ref()
    if saves is None:   # collected: its worker, if any, is idle (a save in flight holds its owner)
        return
    try:
        saves.close_at_exit()
    except Exception:  # the other checkpointers' hooks still run
        logger.exception("closing a checkpointer at interpreter exit failed")
