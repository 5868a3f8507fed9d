"""Checkpointing that does not stall training.

- AsyncCheckpointer: saves block only for the copy to host memory (or, with overlapped
  staging, not even for that until wait_staged()); files are written by a persistent
  background worker, committed atomically with a verified manifest.
- LocalCheckpointManager: fast node-local checkpoints, replicated to peer ranks on other
  nodes, loaded with automatic fallback local -> replica -> persistent checkpoint.

See docs/checkpoint.md.
"""

from nvrx_core.checkpoint.async_checkpointer import AsyncCheckpointer
from nvrx_core.checkpoint.config import CheckpointConfig, LocalCheckpointConfig
from nvrx_core.checkpoint.errors import (CheckpointCorruptError, CheckpointError,
                                         CheckpointNotFoundError, CheckpointSaveError,
                                         SnapshotModifiedError)
from nvrx_core.checkpoint.layout import CheckpointStore, read_manifest, verify_checkpoint
from nvrx_core.checkpoint.local import GLOBAL, LOCAL, REPLICA, LoadedCheckpoint, LocalCheckpointManager
from nvrx_core.events import (CHECKPOINT_ABORTED, CHECKPOINT_FAILED, CHECKPOINT_LOADED,
                              CHECKPOINT_SKIPPED)

__all__ = [
    "AsyncCheckpointer", "CheckpointConfig", "LocalCheckpointConfig",
    "LocalCheckpointManager", "LoadedCheckpoint", "LOCAL", "REPLICA", "GLOBAL",
    "CheckpointError", "CheckpointCorruptError", "CheckpointNotFoundError", "CheckpointSaveError",
    "SnapshotModifiedError",
    "CheckpointStore", "read_manifest", "verify_checkpoint",
    "CHECKPOINT_ABORTED", "CHECKPOINT_FAILED", "CHECKPOINT_SKIPPED", "CHECKPOINT_LOADED",
]
