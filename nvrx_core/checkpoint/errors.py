"""Checkpoint errors; each message names the checkpoint, file or key at fault."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint on disk is incomplete or does not match its manifest (size, checksum)."""


class CheckpointSaveError(CheckpointError):
    """A background save failed; raised in the training thread by finalize()."""


class CheckpointNotFoundError(CheckpointError):
    """No committed, valid checkpoint exists where one was asked for."""


class SnapshotModifiedError(CheckpointSaveError):
    """With overlapped staging, a saved tensor was modified in place before its copy to
    host memory was confirmed; the save was dropped. Raised by wait_staged()/finalize()."""
