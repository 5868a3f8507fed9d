"""AsyncCheckpointer: saves that block training only for the copy to host memory.

    ckpt = AsyncCheckpointer("/lustre/run1/ckpt", CheckpointConfig(keep_last=3))
    for step in ...:
        train_step()
        if step % 100 == 0:
            ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, step)
        ckpt.finalize()          # reports saves committed since; raises their errors
    ckpt.close()                 # waits for what is still in flight

With CheckpointConfig(staging="overlapped") save() returns before the copy to host
memory is done; the loop calls wait_staged() before it modifies the saved tensors:

        ckpt.save(state, step)   # returns at once; the copy overlaps forward/backward
        loss = model(batch).sum(); loss.backward()
        ckpt.wait_staged()       # the snapshot is complete: parameters may change now
        optimizer.step()

Every rank calls save/abort/close the same number of times in the same order. Each rank
writes its own shard into a shared partial directory; then the background worker of
every rank takes part in one tiny all_reduce on a gloo group of its own ("is every shard
of this generation written?"), rank 0 merges the per-rank file lists into the manifest
and publishes the directory by rename, and a second all_reduce tells every rank whether
that worked. The training thread does none of this: finalize() only collects results.
"""

import json
import logging
import os
import random
import shutil
import time
from typing import Any, Callable, List, Optional, Tuple

from nvrx_core import collectives, durable
from nvrx_core.checkpoint.agreed_load import load_everywhere
from nvrx_core.checkpoint.collectives import side_group
from nvrx_core.checkpoint.config import CheckpointConfig
from nvrx_core.checkpoint.errors import (CheckpointCorruptError, CheckpointError,
                                         CheckpointNotFoundError, CheckpointSaveError)
from nvrx_core.checkpoint.layout import (CheckpointStore, FileEntry, Manifest, fragment_name,
                                         partial_dir_name, read_manifest, write_manifest)
from nvrx_core.checkpoint.pipeline import PendingSave
from nvrx_core.checkpoint.pipelined import PipelinedSaves
from nvrx_core.checkpoint.shards import SaveAborted, read_shard, shard_files
from nvrx_core.events import CHECKPOINT_COMMITTED, EventLog

logger = logging.getLogger("nvrx.checkpoint")


class AsyncCheckpointer:
    """Asynchronous, atomic, verified checkpoints of every rank's state under one root.

    Construction is collective when torch.distributed is initialized (every rank of
    `process_group` constructs one).
    """

    def __init__(self, root_dir: str, config: Optional[CheckpointConfig] = None, *,
                 process_group: Any = None, events: Optional[EventLog] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config or CheckpointConfig()
        self.store = CheckpointStore(root_dir)
        self._group = collectives.resolve_group(process_group)
        self.rank, self.world_size = collectives.group_rank_size(self._group)
        self._events = events if events is not None else EventLog.from_env("checkpoint")
        self._saves = PipelinedSaves(self.config, self.rank, settle=self._settle,
                                     events=self._events, clock=clock,
                                     shared_directories=self.world_size > 1)
        # One id per incarnation of the job, agreed by all ranks, names this run's partial
        # directories so a crashed run's leftovers can never be mixed into this run's saves.
        self.run_id = collectives.all_reduce_max(
            [random.SystemRandom().getrandbits(63) if self.rank == 0 else 0], self._group)[0]
        # The background workers agree on their own group, never on the training one.
        self._settle_group = side_group(self._group)
        if self.rank == 0:
            os.makedirs(self.store.root_dir, exist_ok=True)
            removed = self.store.remove_leftovers(self.run_id)
            if removed:
                logger.info("removed leftovers of interrupted saves: %s", removed)

    @property
    def pending_steps(self) -> List[int]:
        """Steps saved but not yet reported by finalize(), oldest first."""
        return self._saves.pending_targets

    @property
    def stale_completions(self) -> int:
        """Completions dropped because their generation was no longer pending."""
        return self._saves.pipeline.stale_completions

    def save(self, state_dict: Any, step: int) -> int:
        """Snapshot `state_dict` to host memory and write it in the background.

        Returns the save's generation id. If max_pending_saves are already in flight, this
        first waits for the oldest to finish (and reports it like finalize()). With
        staging="overlapped" the copy is still running when this returns: no saved tensor
        may be modified in place until wait_staged() has returned.
        """
        pending = self._saves.start(
            state_dict, step,
            lambda gen: os.path.join(self.store.root_dir, partial_dir_name(step, self.run_id, gen)))
        logger.debug("save of step %d staged %d bytes in %.3f s", step, pending.staged_bytes,
                     pending.blocking_seconds)
        return pending.generation

    def wait_staged(self) -> None:
        """Return once every save's copy to host memory is complete and confirmed: from
        then on the saved tensors may be modified. Call it with staging="overlapped"
        before optimizer.step() (cheap when nothing is being copied); with "blocking" it
        returns at once.

        Raises SnapshotModifiedError if a saved tensor was modified in place before its
        copy was confirmed: that save is dropped on every rank (never committed), always,
        whatever fail_on_save_error says - it is a bug in the loop, not a storage fault.
        """
        self._saves.wait_staged()

    def finalize(self, blocking: bool = False) -> List[int]:
        """Steps committed since the last call, oldest first; no communication.

        With blocking=True, waits for every save in flight. A failed save raises
        CheckpointSaveError here, in the training thread, on every rank (or is logged and
        reported as a `checkpoint_failed` event when fail_on_save_error is False). With
        overlapped staging it also confirms the copies that have finished (as wait_staged
        does, without waiting) and a save is committed only once its copy is confirmed.
        """
        return self._saves.finalize(blocking)

    def abort(self, timeout: Optional[float] = None) -> List[int]:
        """Stop every save in flight and delete its partial output; returns their steps.

        Call it on every rank. A save that all ranks had already agreed to commit may
        still be committed (it is complete); committed checkpoints are never touched.
        """
        return self._saves.abort(timeout)

    def close(self) -> None:
        """Wait for the saves in flight, then stop the background threads (again: nothing)."""
        self._saves.close()

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()   # nothing is left in flight for close() to wait for or raise
        self.close()

    # ---- loading ---------------------------------------------------------------------------

    def latest_step(self) -> Optional[int]:
        """The newest committed step on disk (not yet verified; load_latest verifies)."""
        steps = self.store.steps()
        return steps[-1] if steps else None

    def load(self, step: int, *, weights_only: bool = True) -> Any:
        """This rank's state of checkpoint `step`, every byte verified against the manifest."""
        manifest = read_manifest(self.store.path(step))
        if manifest.world_size != self.world_size:
            raise CheckpointError(
                f"{self.store.path(step)} was saved by {manifest.world_size} ranks, this job has "
                f"{self.world_size}; resharding is not supported")
        if self.rank not in manifest.ranks:
            raise CheckpointCorruptError(f"{self.store.path(step)}: no files for rank {self.rank}")
        entries = {n: manifest.files[n] for n in manifest.ranks[self.rank]}
        return read_shard(self.store.path(step), self.rank, entries, manifest.checksum_algo,
                          weights_only=weights_only)

    def load_latest(self, *, weights_only: bool = True) -> Tuple[int, Any]:
        """The newest checkpoint that every rank can load intact, as (step, this rank's state).

        A corrupt or partial checkpoint is reported (log + `checkpoint_skipped` event) and
        the previous one is tried. Raises CheckpointNotFoundError when none is left.
        """
        steps = collectives.all_gather_json(self.store.steps(), self._group)[0]
        for step in reversed(steps):
            attempt = load_everywhere(lambda: self.load(step, weights_only=weights_only),
                                      self._group, f"step {step}")
            if attempt.everywhere:
                return step, attempt.state
            reason = str(attempt.corrupt) if attempt.corrupt else "corrupt on another rank"
            self._saves.skipped(step, reason)
        raise CheckpointNotFoundError(f"no loadable checkpoint under {self.store.root_dir}")

    # ---- settling (background worker) ----------------------------------------------------

    def _settle(self, pending: PendingSave, entries: Optional[List[FileEntry]],
                error: Optional[BaseException]) -> None:
        """Agree with every rank that this generation is fully written, commit on rank 0,
        and agree on the outcome. Raises on every rank if the save did not become durable."""
        if entries is not None:
            try:
                self._write_fragment(pending, entries)
            except Exception as e:  # still take part in the all_reduce below
                error, entries = e, None
        failed = int(entries is None or pending.cancel.is_set())
        gen_max, neg_gen_min, any_failed = collectives.all_reduce_max(
            [pending.generation, -pending.generation, failed], self._settle_group)
        if gen_max != -neg_gen_min:
            raise CheckpointError(
                f"ranks disagree on the checkpoint generation ({-neg_gen_min} .. {gen_max}): "
                "every rank must call save() and abort() the same number of times")
        if any_failed:
            self._remove_partial_dir(pending)
            if error is not None or failed:
                raise error or SaveAborted(f"save of step {pending.step} aborted")
            raise CheckpointSaveError(f"the save of step {pending.step} failed on another "
                                      "rank; see its log")
        commit_error = None
        if self.rank == 0:
            try:
                self._commit(pending, entries)
            except Exception as e:  # every rank learns of it through the next all_reduce
                commit_error = e
        if collectives.all_reduce_max([int(commit_error is not None)], self._settle_group)[0]:
            self._remove_partial_dir(pending)
            raise commit_error or CheckpointSaveError(
                f"rank 0 could not commit step {pending.step}; see its log")

    def _remove_partial_dir(self, pending: PendingSave) -> None:
        """Rank 0, once every rank has stopped writing into it."""
        if self.rank == 0:
            shutil.rmtree(pending.directory, ignore_errors=True)

    def _write_fragment(self, pending: PendingSave, entries: List[FileEntry]) -> None:
        """This rank's written files, for rank 0 to merge into the manifest."""
        durable.atomic_write_json(os.path.join(pending.directory, fragment_name(self.rank)), {
            "rank": self.rank, "step": pending.step, "generation": pending.generation,
            "run_id": f"{self.run_id:016x}", "files": {e.name: e.to_json() for e in entries}})

    def _commit(self, pending: PendingSave, entries: List[FileEntry]) -> None:
        """Rank 0: merge fragments into the manifest, publish the directory, apply retention."""
        files, ranks = {}, {}
        for rank in range(self.world_size):
            fragment = self._read_fragment(pending, rank)
            for name, entry in fragment["files"].items():
                files[name] = FileEntry(name, int(entry["size"]), entry["checksum"])
            ranks[rank] = shard_files(rank, list(fragment["files"]))
        for rank in range(self.world_size):
            os.unlink(os.path.join(pending.directory, fragment_name(rank)))
        write_manifest(pending.directory, Manifest(
            step=pending.step, world_size=self.world_size, generation=pending.generation,
            run_id=self.run_id, checksum_algo=self.config.checksum, ranks=ranks, files=files))
        path = self.store.commit(pending.directory, pending.step)
        deleted = self._housekeeping(pending)
        self._events.emit(CHECKPOINT_COMMITTED, step=pending.step, path=path,
                          generation=pending.generation, bytes=pending.staged_bytes,
                          blocking_s=round(pending.blocking_seconds, 4), deleted_steps=deleted)
        logger.info("committed checkpoint step %d (%s)", pending.step, path)

    def _housekeeping(self, pending: PendingSave) -> List[int]:
        """Retention and leftovers: a failure here does not undo the commit, it is logged."""
        try:
            deleted = self.store.apply_retention(self.config.keep_last)
            self.store.remove_leftovers(self.run_id, keep_from_generation=pending.generation)
            return deleted
        except OSError as e:
            logger.error("checkpoint retention under %s failed: %r", self.store.root_dir, e)
            return []

    def _read_fragment(self, pending: PendingSave, rank: int) -> dict:
        path = os.path.join(pending.directory, fragment_name(rank))
        try:
            with open(path, "rb") as f:
                fragment = json.loads(f.read())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: rank {rank}'s file list is unreadable ({e})") from None
        expected = (pending.generation, f"{self.run_id:016x}", pending.step)
        found = (fragment.get("generation"), fragment.get("run_id"), fragment.get("step"))
        if found != expected:
            raise CheckpointError(f"{path}: belongs to save (generation, run, step)={found}, "
                                  f"expected {expected}; refusing to mix saves")
        return fragment
