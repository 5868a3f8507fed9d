"""NVRxAsyncCheckpointIO: Lightning's CheckpointIO on nvrx_core.checkpoint.

    trainer = Trainer(plugins=[NVRxAsyncCheckpointIO()],
                      callbacks=[ModelCheckpoint(dirpath="ckpt", save_last=True)])
    trainer.fit(model, ckpt_path="last")

A save returns once the checkpoint is copied into host buffers kept from the previous
save (the caller-thread snapshot: from then on the optimizer may change the weights); the
core's background worker writes, checksums, fsyncs and publishes it. Each path Lightning
passes (`epoch=0-step=10.ckpt`, `last.ckpt`) becomes a directory in the core's format,
published atomically under exactly that name, so ModelCheckpoint's listing of
`last*.ckpt` finds it, and a process killed mid-save leaves the previous one intact.

The mechanism is nvrx_core.checkpoint.path_checkpointer.PathCheckpointer; this class maps
Lightning's four calls onto it, starts it on the first save (teardown stops it, so `fit`
may run again) and re-raises a background failure at the next save and at teardown.
Lightning's strategy calls save/remove on global rank 0 only and load on every rank; the
other ranks never start a writer.

Limits: a checkpoint is a directory, so what reads one file with torch.load
(`LightningModule.load_from_checkpoint(path)`, `torch.load(path)`) cannot open it; load it
through the Trainer (`ckpt_path=...`) or `NVRxAsyncCheckpointIO().load_checkpoint(path)`,
which needs no Trainer. Local paths only; one writing process per directory.
"""

import dataclasses
import logging
import os
import sys
from typing import Any, Mapping, Optional, Union

import torch

from nvrx_core.checkpoint.config import CheckpointConfig
from nvrx_core.checkpoint.path_checkpointer import (PathCheckpointer, checkpoint_path,
                                                    is_path_checkpoint, load_path)
from nvrx_core.checkpoint.path_publish import remove_checkpoint
from nvrx_core.config import build, check
from nvrx_lightning._compat import CheckpointIO, pl

logger = logging.getLogger("nvrx.lightning.checkpoint")

DEFAULT_MAX_PENDING_SAVES = 2
"""ModelCheckpoint with save_last=True saves the same state twice in a row (top-k, then
last): a second staging buffer set lets the second save start without waiting for the
first to be written."""


@dataclasses.dataclass
class SaveOptions:
    """What `storage_options` may hold (a mapping with these keys, all optional)."""

    blocking: bool = False
    """Return only once this save is durable at its path (e.g. a final save before exit)."""

    def __post_init__(self) -> None:
        check(isinstance(self.blocking, bool), "storage_options['blocking']", self.blocking,
              "must be true or false")


class NVRxAsyncCheckpointIO(CheckpointIO):
    """Asynchronous, atomic, verified checkpoints for Lightning's Trainer.

    Args:
        checkpoint_io: loads and removes what this plugin did not write (a plain file, or a
            remote URL), e.g. a checkpoint saved before the plugin was added. Default:
            Lightning's TorchCheckpointIO.
        config: nvrx_core's CheckpointConfig, or a mapping of its fields overriding this
            plugin's defaults (max_pending_saves=2). staging must stay "blocking" (the
            plugin cannot see the optimizer step); keep_last is unused (ModelCheckpoint
            removes old checkpoints).
    """

    def __init__(self, checkpoint_io: Optional[CheckpointIO] = None,
                 config: Union[CheckpointConfig, Mapping[str, Any], None] = None) -> None:
        super().__init__()
        if checkpoint_io is not None and (not isinstance(checkpoint_io, CheckpointIO)
                                          or isinstance(checkpoint_io, NVRxAsyncCheckpointIO)):
            raise TypeError(f"checkpoint_io={checkpoint_io!r}: must be None or a Lightning "
                            "CheckpointIO other than NVRxAsyncCheckpointIO (it loads and removes "
                            "the checkpoints this plugin did not write)")
        self._checkpoint_io = checkpoint_io
        self.config = _build_config(config)
        self._checkpointer: Optional[PathCheckpointer] = None

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """The IO for paths this plugin did not write; Lightning's TorchCheckpointIO unless given."""
        if self._checkpoint_io is None:
            self._checkpoint_io = pl.plugins.io.TorchCheckpointIO()
        return self._checkpoint_io

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Optional[Any] = None) -> None:
        """Snapshot `checkpoint` and write it to `path` in the background.

        Returns once the tensors are copied to host memory. Raises the error of an earlier
        save that failed in the background (CheckpointSaveError)."""
        options = _save_options(storage_options)
        if not isinstance(checkpoint, dict):
            raise TypeError(f"checkpoint: must be a dict (Lightning's checkpoint), got "
                            f"{type(checkpoint).__name__}")
        target = checkpoint_path(path)
        step = checkpoint.get("global_step", 0)
        step = step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else 0
        if self._checkpointer is None:
            self._checkpointer = PathCheckpointer(self.config)
        self._checkpointer.save(checkpoint, target, step=step)
        if options.blocking:
            self._checkpointer.wait_for(target)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict:
        """Load `path`, first finishing a save to it still in flight. weights_only=None is
        torch.load's default (True); map_location: None (CPU), a device or its name."""
        if _is_remote(path):
            return self.checkpoint_io.load_checkpoint(path, map_location=map_location,
                                                      weights_only=weights_only)
        target = checkpoint_path(path)
        if self._checkpointer is not None:
            self._checkpointer.wait_for(target)
        if not is_path_checkpoint(target):
            kwargs = {} if map_location is None else {"map_location": map_location}
            return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only, **kwargs)
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError(f"map_location={map_location!r}: for a checkpoint written by "
                            "NVRxAsyncCheckpointIO it must be None, a device name or a torch.device")
        return load_path(target, weights_only=weights_only, map_location=map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete `path`, first finishing a save to it still in flight (so it cannot reappear)."""
        if _is_remote(path):
            self.checkpoint_io.remove_checkpoint(path)
            return
        target = checkpoint_path(path)
        if self._checkpointer is not None:
            self._checkpointer.wait_for(target)
        if not (os.path.islink(target) or is_path_checkpoint(target)):
            self.checkpoint_io.remove_checkpoint(path)
        elif self._checkpointer is not None:
            self._checkpointer.remove(target)        # the bytes are freed in the background
        else:
            remove_checkpoint(target, os.getpid())
        logger.debug("removed checkpoint %s", target)

    def teardown(self) -> None:
        """Wait for the saves in flight and stop the writer; a later save starts a new one.

        Raises a background failure, except while another exception is being handled (Lightning
        tears down on its way out of a failed or interrupted fit): then it is logged, so the
        original error and Lightning's shutdown steps are not replaced by it."""
        handling = sys.exc_info()[1]
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is None:
            return
        try:
            checkpointer.close()
        except Exception:
            if handling is None:
                raise
            logger.exception("a background checkpoint save failed while %r was being handled",
                             handling)

    def __getstate__(self) -> dict:
        # Spawn-based strategies pickle the Trainer: a started writer (threads, buffers)
        # stays with this process; a copy starts its own on its first save.
        state = dict(self.__dict__)
        state["_checkpointer"] = None
        return state


def _build_config(config: Union[CheckpointConfig, Mapping[str, Any], None]) -> CheckpointConfig:
    if config is None:
        built = CheckpointConfig(max_pending_saves=DEFAULT_MAX_PENDING_SAVES)
    elif isinstance(config, CheckpointConfig):
        built = config
    elif isinstance(config, Mapping):
        built = build(CheckpointConfig, {"max_pending_saves": DEFAULT_MAX_PENDING_SAVES}, config,
                      source="NVRxAsyncCheckpointIO(config=...)")
    else:
        raise TypeError(f"config={config!r}: must be None, a CheckpointConfig or a mapping of its fields")
    check(built.staging == "blocking", "config.staging", built.staging,
          "NVRxAsyncCheckpointIO needs 'blocking': Lightning saves after the optimizer step, "
          "and nothing would call wait_staged() before the next one")
    return built


def _save_options(storage_options: Optional[Any]) -> SaveOptions:
    if storage_options is None:
        return SaveOptions()
    if not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options={storage_options!r}: must be None or a mapping; "
                        f"known keys: {', '.join(f.name for f in dataclasses.fields(SaveOptions))}")
    return build(SaveOptions, storage_options, source="storage_options")   # ConfigError: a ValueError


def _is_remote(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and "://" in os.fspath(path)
