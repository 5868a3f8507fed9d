"""PathCheckpointer: asynchronous saves of one process's state, each to a path the caller names.

AsyncCheckpointer owns a directory of numbered steps and their retention; frameworks such
as Lightning instead name every checkpoint themselves (`epoch=3-step=400.ckpt`,
`last.ckpt` saved over and over), delete old ones themselves, and find them again by
listing the directory. This is the same save pipeline for that world:

    ckpt = PathCheckpointer(CheckpointConfig(max_pending_saves=2))
    ckpt.save(state, "/ckpt/last.ckpt", step=400)   # returns once the state is copied
    ...                                             # training goes on; one thread writes
    state = ckpt.load("/ckpt/last.ckpt")            # finishes that path's write first
    ckpt.remove("/ckpt/epoch=1-step=200.ckpt")      # likewise
    ckpt.close()                                    # waits for the saves in flight

Each path becomes a directory in the AsyncCheckpointer's format (manifest with every
file's size and checksum, one rank's index and data files) published atomically
(path_publish): a crash at any moment leaves the previous checkpoint at that path intact.
One process writes: no collective is run, so in a job where only one rank saves, only that
rank creates one. Failed saves raise CheckpointSaveError in the caller's thread, at the
next save, wait_for, load, remove, finalize or close.
"""

import concurrent.futures
import logging
import os
import random
import shutil
import time
from typing import Any, Callable, Dict, List, Optional, Union

import torch

from nvrx_core.checkpoint.config import CheckpointConfig
from nvrx_core.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from nvrx_core.checkpoint.layout import MANIFEST, FileEntry, Manifest, read_manifest, write_manifest
from nvrx_core.checkpoint.path_publish import (hidden_name, hold_writer_lock, publish,
                                               release_writer_lock, remove_checkpoint,
                                               remove_entry, sweep_leftovers)
from nvrx_core.checkpoint.pipeline import PendingSave
from nvrx_core.checkpoint.pipelined import PipelinedSaves
from nvrx_core.checkpoint.shards import SaveAborted, read_shard
from nvrx_core.events import CHECKPOINT_COMMITTED, EventLog

logger = logging.getLogger("nvrx.checkpoint")

PathLike = Union[str, "os.PathLike[str]"]


def checkpoint_path(path: Any, argument: str = "path") -> str:
    """`path` as an absolute local path; a clear error for anything else."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{argument}={path!r}: must be a str or os.PathLike")
    path = os.fspath(path)
    if not isinstance(path, str) or path == "":
        raise TypeError(f"{argument}={path!r}: must be a non-empty path")
    if "://" in path:
        raise ValueError(f"{argument}={path!r}: only local (POSIX) paths can be written "
                         "atomically; remote URLs are not supported")
    return os.path.abspath(os.path.expanduser(path))


def _entry_key(path: str) -> str:
    """The directory entry `path` names (its parent resolved), whether or not it exists."""
    directory, base = os.path.split(path)
    return os.path.join(os.path.realpath(directory), base)


def is_path_checkpoint(path: PathLike) -> bool:
    """True if `path` (after symlinks) is a committed checkpoint directory of this format."""
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST))


def load_path(path: PathLike, *, weights_only: Optional[bool] = True,
              map_location: Union[None, str, torch.device] = None) -> Any:
    """The state saved at `path`, every byte verified against its manifest.

    weights_only as torch.load (None: torch's default, True); map_location None keeps the
    tensors on the CPU, a device (or its name) moves them there.
    """
    path = checkpoint_path(path)
    if map_location is not None and not isinstance(map_location, (str, torch.device)):
        raise TypeError(f"map_location={map_location!r}: must be None, a device name or a "
                        "torch.device")
    device = torch.device(map_location) if map_location is not None else None
    if not os.path.lexists(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}")
    directory = os.path.realpath(path)
    manifest = read_manifest(directory)
    if manifest.world_size != 1 or 0 not in manifest.ranks:
        raise CheckpointError(f"{path} was saved by {manifest.world_size} ranks; load_path reads "
                              "single-process checkpoints (use AsyncCheckpointer.load)")
    entries = {name: manifest.files[name] for name in manifest.ranks[0]}
    state = read_shard(directory, 0, entries, manifest.checksum_algo,
                       weights_only=True if weights_only is None else weights_only)
    return state if device is None else _to_device(state, device)


def _to_device(node: Any, device: torch.device) -> Any:
    if isinstance(node, torch.Tensor):
        return node.to(device)
    if isinstance(node, dict):
        for key, value in node.items():
            node[key] = _to_device(value, device)
        return node
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*(_to_device(v, device) for v in node))
    if isinstance(node, (list, tuple)):
        return type(node)(_to_device(v, device) for v in node)
    return node


class PathCheckpointer:
    """Asynchronous, atomic, verified checkpoints of one process's state at named paths.

    One thread (the training thread) calls its methods; the saves themselves are written
    by the pipeline's background worker, in the order they were made.
    """

    def __init__(self, config: Optional[CheckpointConfig] = None, *,
                 events: Optional[EventLog] = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or CheckpointConfig()
        if not isinstance(self.config, CheckpointConfig):
            raise TypeError(f"config={config!r}: must be a CheckpointConfig or None")
        self._events = events if events is not None else EventLog.from_env("checkpoint")
        self._saves = PipelinedSaves(self.config, 0, settle=self._settle, events=self._events,
                                     clock=clock, target_field="path", on_close=self._release)
        # Names this incarnation's hidden directories: another run's are crash leftovers.
        self.run_id = random.SystemRandom().getrandbits(63)
        self._locks: Dict[str, Optional[int]] = {}   # directory -> writer lock descriptor
        self._removals = 0
        self._deleter: Optional[concurrent.futures.ThreadPoolExecutor] = None

    @property
    def pending_paths(self) -> List[str]:
        """Paths saved but not yet reported by finalize(), oldest first."""
        return self._saves.pending_targets

    def save(self, state_dict: Any, path: PathLike, step: int = 0) -> int:
        """Snapshot `state_dict` to host memory and write it to `path` in the background.

        Returns the save's generation. With max_pending_saves saves in flight this first
        waits for the oldest. With staging="blocking" (the default) the saved tensors may
        be modified as soon as this returns; with "overlapped" only after wait_staged().
        A later save of the same path replaces it once written.
        """
        target = _entry_key(checkpoint_path(path))
        directory = os.path.dirname(target)
        if directory not in self._locks:
            os.makedirs(directory, exist_ok=True)
            self._locks[directory] = hold_writer_lock(directory, self.run_id)
            handled = sweep_leftovers(directory, self.run_id)
            if handled:
                logger.info("cleaned up after interrupted saves in %s: %s", directory, handled)
        pending = self._saves.start(
            state_dict, step, lambda gen: hidden_name(target, "partial", self.run_id, gen), target)
        logger.debug("save to %s staged %d bytes in %.3f s", target, pending.staged_bytes,
                     pending.blocking_seconds)
        return pending.generation

    def wait_staged(self) -> None:
        """With staging="overlapped": return once every copy is complete (see AsyncCheckpointer)."""
        self._saves.wait_staged()

    def wait_for(self, path: PathLike) -> None:
        """Finish every save in flight to `path` (and the saves made before it)."""
        wanted = {_entry_key(checkpoint_path(path)), os.path.realpath(checkpoint_path(path))}
        pending = self._saves.pending_targets
        last = max((i for i, target in enumerate(pending) if target in wanted), default=-1)
        if last >= 0:
            self._saves.finish(last + 1)

    def finalize(self, blocking: bool = False) -> List[str]:
        """Paths committed since the last call, oldest first; raises a failed save's error
        (CheckpointSaveError) unless fail_on_save_error is False. blocking: wait for all."""
        return self._saves.finalize(blocking)

    def load(self, path: PathLike, *, weights_only: Optional[bool] = True,
             map_location: Union[None, str, torch.device] = None) -> Any:
        """The state at `path`, after finishing a save to it still in flight."""
        self.wait_for(path)
        return load_path(path, weights_only=weights_only, map_location=map_location)

    def remove(self, path: PathLike) -> bool:
        """Delete the checkpoint at `path`, after finishing a save to it still in flight
        (so it cannot reappear). Returns whether anything was there. The name is gone when
        this returns; the bytes are freed by a background thread (close() waits for it)."""
        self.wait_for(path)
        self._removals += 1
        return remove_checkpoint(checkpoint_path(path), self.run_id, self._removals,
                                 delete=self._delete_later)

    def close(self) -> None:
        """Wait for the saves in flight and the deletions, then stop the background threads
        (again: nothing)."""
        self._saves.close()

    def __enter__(self) -> "PathCheckpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    # ---- training thread --------------------------------------------------------------------

    def _release(self) -> None:
        """close()'s part after the pipeline's: the deletions finished, the writer locks freed."""
        if self._deleter is not None:
            self._deleter.shutdown(wait=True)
            self._deleter = None
        for directory, fd in self._locks.items():
            release_writer_lock(fd, directory, self.run_id)
        self._locks.clear()

    def _delete_later(self, trash: str) -> None:
        if self._deleter is None:
            self._deleter = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="nvrx-ckpt-delete")
        self._deleter.submit(remove_entry, trash)

    # ---- background worker ------------------------------------------------------------------

    def _settle(self, pending: PendingSave, entries: Optional[List[FileEntry]],
                error: Optional[BaseException]) -> str:
        """Write the manifest and publish the directory at its target path."""
        if entries is None or pending.cancel.is_set():
            raise error or SaveAborted(f"save of step {pending.step} aborted")
        target = pending.target
        try:
            write_manifest(pending.directory, Manifest(
                step=pending.step, world_size=1, generation=pending.generation,
                run_id=self.run_id, checksum_algo=self.config.checksum,
                ranks={0: [e.name for e in entries]}, files={e.name: e for e in entries}))
            replaced = publish(pending.directory, target, self.run_id, pending.generation)
        except BaseException:
            shutil.rmtree(pending.directory, ignore_errors=True)
            raise
        self._events.emit(CHECKPOINT_COMMITTED, step=pending.step, path=target,
                          generation=pending.generation, bytes=pending.staged_bytes,
                          blocking_s=round(pending.blocking_seconds, 4), replaced=replaced)
        logger.info("committed checkpoint %s", target)
        return target
