"""The save pipeline shared by the persistent and the node-local checkpointers.

The training thread stages a state dict into host buffers and hands it to one persistent
background thread (created on the first save, reused by every later one). That worker
writes the files with a pool of writer threads, then runs the owner's settle hook, which
does everything else a save needs - agreeing with the other ranks, committing,
replicating - so the training thread never waits on a collective, an fsync or a delete.

With overlapped staging the copy to host memory also leaves the training thread: it
runs on a staging thread, and the worker may write the copied bytes but commits them
only after the training thread has confirmed the snapshot (confirm_staged, called from
wait_staged() and every finalize()).

Each save carries a generation id; a completion whose generation is no longer pending
(its save was aborted and disowned) is stale and is dropped: it can never be taken for
the completion of a newer save.

Threads, not a forked process: the staged buffers are shared with the writers without a
copy, and nothing is forked from a process that holds CUDA contexts and NCCL threads.

The worker is a daemon thread, which the interpreter does not wait for at exit: it stops
it wherever it is, and when a worker inside a collective or a write returns from that call
into a finalizing interpreter, the thread's exit aborts the process (std::terminate, exit
code -6). So a pipeline still running at exit (its owner never called close()) must be
closed while the interpreter is still whole, before concurrent.futures stops the writer
threads from taking work: its owner's PipelinedSaves (pipelined.py) does that, through
nvrx_core.teardown.finish_before_exit.
"""

import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from nvrx_core.checkpoint.config import CheckpointConfig
from nvrx_core.checkpoint.errors import CheckpointError, SnapshotModifiedError
from nvrx_core.checkpoint.layout import FileEntry, rank_prefix
from nvrx_core.checkpoint.shards import SaveAborted, write_shard
from nvrx_core.checkpoint.staging import HostStager, StagedState, StagingJob

logger = logging.getLogger("nvrx.checkpoint")

SettleHook = Callable[["PendingSave", Optional[List[FileEntry]], Optional[BaseException]], Any]
"""Runs on the worker after a save's files are written (or writing failed: entries None
and the error given). It must take part in any exchange with other ranks whatever the
local outcome, honour pending.cancel, and raise if the save is not durable in the end;
what it returns becomes SaveResult.extra."""


@dataclasses.dataclass
class PendingSave:
    generation: int
    step: int
    directory: str
    rank: int
    cancel: threading.Event
    staged_bytes: int
    blocking_seconds: float
    started: float
    settle: Optional[SettleHook] = None
    staging: Optional[StagingJob] = None
    """Overlapped staging only: the copy in flight and its confirmation."""
    target: Any = None
    """What the owner reports once the save is committed: its step, or the path it goes to."""
    result: Optional["SaveResult"] = None


@dataclasses.dataclass
class SaveResult:
    generation: int
    entries: List[FileEntry]
    extra: Any
    error: Optional[BaseException]
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None


class SavePipeline:
    """Staging + one persistent worker thread + writer threads, with generation bookkeeping.

    Not thread-safe for callers: start/poll/wait/abort belong to the training thread.
    """

    def __init__(self, config: CheckpointConfig, rank: int, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.rank = rank
        self._clock = clock
        self._stager = HostStager(pin_memory=config.pin_memory, max_sets=config.max_pending_saves,
                                  copy_threads=config.staging_threads)
        self._requests: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._results: "queue.Queue[SaveResult]" = queue.Queue()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._thread: Optional[threading.Thread] = None
        # Never more writers than half the cores: the background write must leave the
        # training loop most of the CPU (on a 2-core host: one writer).
        self.writer_threads = max(1, min(config.writer_threads, (os.cpu_count() or 2) // 2))
        self._next_generation = 1
        self.pending: Dict[int, PendingSave] = {}
        self.stale_completions = 0

    # ---- training-thread side -------------------------------------------------------------

    def start(self, state: Any, step: int, directory_for: Callable[[int], str],
              settle: Optional[SettleHook] = None, target: Any = None) -> PendingSave:
        """Stage `state` (all of it blocking, or with overlapped staging only the start
        of the copy) and queue it for writing into `directory_for(generation)`. `target`
        (default: the step) is kept on the PendingSave for the owner and its settle hook."""
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step={step!r}: must be an integer >= 0")
        began = self._clock()
        job = None
        if self.config.staging == "overlapped":
            job = self._stager.stage_async(state)
            staged = job.staged
        else:
            staged = self._stager.stage(state)
        pending = PendingSave(
            generation=self._next_generation, step=step,
            directory=directory_for(self._next_generation), rank=self.rank,
            cancel=threading.Event(), staged_bytes=staged.nbytes,
            blocking_seconds=self._clock() - began, started=began, settle=settle, staging=job,
            target=step if target is None else target)
        self._next_generation += 1
        self.pending[pending.generation] = pending
        self._ensure_worker()
        self._requests.put((pending, staged))
        return pending

    def confirm_staged(self, block: bool, raise_errors: bool = True) -> None:
        """Give the verdict on every overlapped copy that has finished (with block: on all
        of them, waiting for the copies). A save whose tensors were modified in place since
        it began is dropped; the first such error is raised (once: a verdict is final)
        after every verdict is in, any others are logged.

        Must run on the thread that modifies the saved tensors (see StagingJob)."""
        errors = []
        for pending in sorted(self.pending.values(), key=lambda p: p.generation):
            job = pending.staging
            if job is None or job.confirmed.is_set():
                continue
            if not job.copied.done():
                if not block:
                    continue
                began = self._clock()
                concurrent.futures.wait([job.copied])
                pending.blocking_seconds += self._clock() - began
            modified = job.modified_paths() if job.copied.exception() is None else []
            error = _snapshot_modified(pending.step, modified) if modified else None
            job.conclude(error)
            if error is not None:
                errors.append(error)
        for error in errors[1 if raise_errors else 0:]:
            logger.error("%s", error)
        if errors and raise_errors:
            raise errors[0]

    @property
    def started(self) -> bool:
        """Whether the worker runs (from the first start() until close())."""
        return self._thread is not None

    def oldest(self) -> Optional[PendingSave]:
        return self.pending[min(self.pending)] if self.pending else None

    def poll(self) -> None:
        """Attach every completion that has arrived to its pending save; drop stale ones."""
        while True:
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                return
            self._attach(result)

    def wait(self, pending: PendingSave, timeout: Optional[float] = None) -> bool:
        """Block until `pending` has a result; False if the timeout ran out first. Results
        that have already arrived are taken first, so even a zero timeout sees them."""
        self.poll()
        deadline = None if timeout is None else self._clock() + timeout
        while pending.result is None:
            remaining = 1.0 if deadline is None else deadline - self._clock()
            if remaining <= 0:
                return False
            try:
                self._attach(self._results.get(timeout=min(remaining, 1.0)))
            except queue.Empty:
                if self._thread is None or not self._thread.is_alive():
                    raise CheckpointError("the checkpoint worker thread is gone; the save of "
                                          f"step {pending.step} can never complete") from None
        return True

    def take_finished(self, block_first: int) -> List[PendingSave]:
        """Pending saves that have a result, oldest first, stopping at the first without;
        the first `block_first` of them are waited for. They stop being pending."""
        finished = []
        self.confirm_staged(block=block_first > 0)
        self.poll()
        while self.pending:
            pending = self.oldest()
            if block_first > 0:
                self.wait(pending)
                block_first -= 1
            if pending.result is None:
                break
            self.forget(pending)
            finished.append(pending)
        return finished

    def forget(self, pending: PendingSave) -> None:
        """The save is finished with; a late completion for it is stale."""
        self.pending.pop(pending.generation, None)

    def abort_all(self, timeout: Optional[float] = None) -> List[PendingSave]:
        """Cancel every pending save and wait (up to `timeout` s in all) for the worker to
        let go of each. A save that does not stop in time is disowned: it is no longer
        pending, so its completion will be dropped as stale, and the worker deletes its
        files when it notices the cancellation."""
        aborted = sorted(self.pending.values(), key=lambda p: p.generation)
        for pending in aborted:
            pending.cancel.set()
            if pending.staging is not None and not pending.staging.confirmed.is_set():
                pending.staging.conclude(None)   # the cancellation decides its fate
        deadline = None if timeout is None else self._clock() + timeout
        for pending in aborted:
            remaining = None if deadline is None else max(0.0, deadline - self._clock())
            if not self.wait(pending, remaining):
                logger.warning("abort: the save of step %d (generation %d) is still stopping; "
                               "it was disowned", pending.step, pending.generation)
            self.forget(pending)
        return aborted

    def close(self) -> None:
        # A save still unconfirmed (its finalize raised) gets its verdict, so the worker
        # can finish it; a modified snapshot is logged here instead of raised.
        self.confirm_staged(block=True, raise_errors=False)
        if self._thread is not None:
            self._requests.put(None)
            self._thread.join()
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._stager.close()

    def _attach(self, result: SaveResult) -> None:
        pending = self.pending.get(result.generation)
        if pending is None:
            self.stale_completions += 1
            logger.warning("dropped a stale save completion (generation %d is no longer pending)",
                           result.generation)
            return
        pending.result = result

    def _ensure_worker(self) -> None:
        if self._thread is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.writer_threads, thread_name_prefix="nvrx-ckpt-writer")
            self._thread = threading.Thread(target=self._worker_loop, name="nvrx-ckpt-worker",
                                            daemon=True)
            self._thread.start()

    # ---- worker side -----------------------------------------------------------------------

    def _worker_loop(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            pending, staged = item
            try:
                result = self._write(pending, staged)
            except BaseException as e:  # the worker must outlive any one save
                logger.exception("checkpoint worker: unexpected error in the save of step %d",
                                 pending.step)
                result = SaveResult(pending.generation, [], None, e, 0.0)
            self._results.put(result)

    def _write(self, pending: PendingSave, staged: StagedState) -> SaveResult:
        began = self._clock()
        entries: Optional[List[FileEntry]] = None
        extra = error = None
        job = pending.staging
        try:
            if job is not None:
                job.copied.result()   # the overlapped copy must be done before writing
            if pending.cancel.is_set():
                raise SaveAborted(f"save of step {pending.step} aborted before it started")
            os.makedirs(pending.directory, exist_ok=True)
            entries = write_shard(staged, pending.directory, pending.rank, self._pool,
                                  self.writer_threads, self.config.checksum,
                                  self.config.chunk_bytes, pending.cancel, self.config.direct_io)
        except BaseException as e:  # reported to the training thread, never swallowed
            error = e
        finally:
            self._stager.release(staged)   # the next save may stage while this one settles
        if job is not None:
            job.confirmed.wait()    # written, but committed only if the snapshot was good
            error = job.error or error
        if pending.settle is not None:
            try:
                extra = pending.settle(pending, entries if error is None else None, error)
            except BaseException as e:
                error = error or e
        elif error is None and pending.cancel.is_set():
            error = SaveAborted(f"save of step {pending.step} aborted after it was written")
        if error is not None:
            if not isinstance(error, (SaveAborted, SnapshotModifiedError)):  # logged when found
                logger.error("background save of step %d failed: %r", pending.step, error)
            remove_rank_files(pending.directory, pending.rank)
        return SaveResult(pending.generation, entries or [], extra, error, self._clock() - began)


def _snapshot_modified(step: int, modified: List[str]) -> SnapshotModifiedError:
    shown = ", ".join(modified[:4]) + (f" and {len(modified) - 4} more" if len(modified) > 4 else "")
    return SnapshotModifiedError(
        f"checkpoint save of step {step} dropped: {len(modified)} saved tensor(s) were "
        f"modified in place before their copy to host memory was confirmed ({shown}). With "
        "staging='overlapped', call wait_staged() after save() and before optimizer.step() or "
        "any other in-place update. Nothing was committed for this step; earlier checkpoints "
        "are intact.")


def remove_rank_files(directory: str, rank: int) -> None:
    """Delete one rank's files from a partial directory, and the directory once empty."""
    prefix = rank_prefix(rank) + "."
    try:
        names = os.listdir(directory)
    except OSError:  # never created, already removed, or not a directory
        return
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError as e:
                logger.warning("could not remove %s: %r", os.path.join(directory, name), e)
    try:
        os.rmdir(directory)
    except OSError:
        pass  # other ranks' files are still there (they remove their own), or already gone
