"""Checkpoint configs: validated dataclasses, loadable from the `checkpoint:` and
`local_checkpoint:` sections of a YAML file (see configs/checkpoint.yaml).

Layering follows the project rule: dataclass defaults < YAML section < CLI overrides.
"""

import dataclasses
from typing import Any, Mapping, Optional

from nvrx_core.config import build, check, load_yaml_section

CHECKSUMS = ("crc32", "adler32", "none")
STAGING_MODES = ("blocking", "overlapped")


@dataclasses.dataclass
class CheckpointConfig:
    """How the AsyncCheckpointer writes, keeps and verifies checkpoints."""

    writer_threads: int = 2
    """Threads writing one save's shard files in parallel (the persistent worker owns them);
    capped at half the CPU count so the background write leaves training most cores."""

    keep_last: int = 3
    """Committed checkpoints kept under root_dir; older ones are deleted. 0 keeps all."""

    checksum: str = "crc32"
    """Checksum of every written file, stored in the manifest and verified on load."""

    max_pending_saves: int = 1
    """Saves that may be in flight at once. A save beyond this waits for the oldest one
    to finish writing (each in-flight save holds one set of host staging buffers)."""

    fail_on_save_error: bool = True
    """If False, a failed background save is logged and reported as an event instead of
    raising in the training thread; the previous checkpoint stays the latest."""

    pin_memory: bool = True
    """Stage CUDA tensors into page-locked host buffers (reused across saves). Ignored for
    CPU tensors."""

    chunk_bytes: int = 64 << 20
    """Size of one write (and checksum) call; abort() is noticed between chunks."""

    staging_threads: int = 4
    """Threads copying CPU tensors into the staging buffers (capped at the CPU count);
    this copy is the part of a save the training loop waits for."""

    staging: str = "blocking"
    """When save() returns. blocking: once the state is copied to host memory. overlapped:
    at once, and the copy runs while training goes on; the caller must call
    wait_staged() before modifying any saved tensor in place (before optimizer.step()).
    A save whose tensors were modified before the copy was confirmed is dropped with
    SnapshotModifiedError; the check cannot see writes that bypass torch's version counter
    (fused optimizers, tensor.data, numpy views), hence not the default."""

    direct_io: bool = True
    """Write the data files with O_DIRECT, bypassing the page cache, where the filesystem
    allows it (else buffered, as with False). A buffered write of 1 GiB cost ~2-3 s of CPU
    taken from training on a 2-core VM; O_DIRECT ~0.3 s (see docs/checkpoint.md)."""

    def __post_init__(self) -> None:
        check(isinstance(self.writer_threads, int) and 1 <= self.writer_threads <= 64,
              "writer_threads", self.writer_threads, "must be an integer in [1, 64]")
        check(isinstance(self.direct_io, bool), "direct_io", self.direct_io, "must be true or false")
        check(isinstance(self.keep_last, int) and self.keep_last >= 0,
              "keep_last", self.keep_last, "must be an integer >= 0 (0 keeps all)")
        check(self.checksum in CHECKSUMS, "checksum", self.checksum,
              f"must be one of {', '.join(CHECKSUMS)}")
        check(isinstance(self.max_pending_saves, int) and 1 <= self.max_pending_saves <= 8,
              "max_pending_saves", self.max_pending_saves, "must be an integer in [1, 8]")
        check(isinstance(self.fail_on_save_error, bool), "fail_on_save_error",
              self.fail_on_save_error, "must be true or false")
        check(isinstance(self.pin_memory, bool), "pin_memory", self.pin_memory,
              "must be true or false")
        check(isinstance(self.chunk_bytes, int) and (1 << 16) <= self.chunk_bytes <= (1 << 30),
              "chunk_bytes", self.chunk_bytes, "must be an integer in [65536, 2**30]")
        check(isinstance(self.staging_threads, int) and 1 <= self.staging_threads <= 64,
              "staging_threads", self.staging_threads, "must be an integer in [1, 64]")
        check(self.staging in STAGING_MODES, "staging", self.staging,
              f"must be one of {', '.join(STAGING_MODES)}")

    @classmethod
    def from_sources(cls, yaml_path: Optional[str] = None,
                     overrides: Mapping[str, Any] = ()) -> "CheckpointConfig":
        layers = [load_yaml_section(yaml_path, "checkpoint")] if yaml_path else []
        return build(cls, *layers, dict(overrides), source=yaml_path or "checkpoint config")


@dataclasses.dataclass
class LocalCheckpointConfig:
    """Node-local checkpoints: where they go, how many peers hold a replica of each shard."""

    root_dir: str = "/dev/shm/nvrx_local_ckpt"
    """Node-local storage (tmpfs or local NVMe); each rank writes under rank_<r>/."""

    replication_factor: int = 0
    """Peer ranks (on other nodes) that keep a copy of each rank's shard. 0 disables."""

    ranks_per_node: Optional[int] = None
    """Ranks per node, used to pick replica holders on other nodes. None reads
    LOCAL_WORLD_SIZE (set by torchrun / ft_launcher)."""

    keep_last: int = 2
    """Local checkpoints (and replicas) kept per rank."""

    replication_timeout_s: float = 600.0
    """How long a shard exchange with peer ranks may take before the save fails (a dead
    peer would otherwise block the background worker forever)."""

    writer_threads: int = 2
    checksum: str = "crc32"

    def __post_init__(self) -> None:
        check(isinstance(self.root_dir, str) and self.root_dir != "", "root_dir",
              self.root_dir, "must be a non-empty path")
        check(isinstance(self.replication_factor, int) and 0 <= self.replication_factor <= 16,
              "replication_factor", self.replication_factor, "must be an integer in [0, 16]")
        check(self.ranks_per_node is None
              or (isinstance(self.ranks_per_node, int) and self.ranks_per_node >= 1),
              "ranks_per_node", self.ranks_per_node, "must be null or an integer >= 1")
        check(isinstance(self.keep_last, int) and self.keep_last >= 1,
              "keep_last", self.keep_last, "must be an integer >= 1")
        check(isinstance(self.writer_threads, int) and 1 <= self.writer_threads <= 64,
              "writer_threads", self.writer_threads, "must be an integer in [1, 64]")
        check(self.checksum in CHECKSUMS, "checksum", self.checksum,
              f"must be one of {', '.join(CHECKSUMS)}")
        check(isinstance(self.replication_timeout_s, (int, float)) and self.replication_timeout_s > 0,
              "replication_timeout_s", self.replication_timeout_s, "must be a number > 0")

    @classmethod
    def from_sources(cls, yaml_path: Optional[str] = None,
                     overrides: Mapping[str, Any] = ()) -> "LocalCheckpointConfig":
        layers = [load_yaml_section(yaml_path, "local_checkpoint")] if yaml_path else []
        return build(cls, *layers, dict(overrides), source=yaml_path or "local checkpoint config")

    def writer_config(self) -> CheckpointConfig:
        """The AsyncCheckpointer settings used for the node-local tier."""
        return CheckpointConfig(writer_threads=self.writer_threads, keep_last=self.keep_last,
                                checksum=self.checksum)
