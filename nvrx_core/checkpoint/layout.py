"""On-disk layout: atomic checkpoint directories with a manifest, verification, retention.

    <root>/step_0000000100/            a committed checkpoint (the only kind a loader reads)
        manifest.json                  step, world size, generation, every file's size+checksum
        rank_00000.index               rank 0's skeleton + tensor table
        rank_00000.data0 ...           rank 0's raw tensor bytes, one file per writer thread
    <root>/.partial-step_..-<run>-g<gen>/   a save in progress (or abandoned by a crash)

A checkpoint directory appears under its final name only by rename after every file and
the manifest are fsynced, so a crash at any moment leaves either the old set of committed
checkpoints or the old set plus the new one, never a half-written step_* directory.
"""

import dataclasses
import json
import logging
import os
import re
import shutil
import time
import zlib
from typing import Dict, Iterable, List, Optional

from nvrx_core import durable
from nvrx_core.checkpoint.errors import CheckpointCorruptError

logger = logging.getLogger("nvrx.checkpoint")

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{10})$")
_PARTIAL_DIR = re.compile(r"^\.partial-step_(\d{10})-([0-9a-f]{16})-g(\d+)$")
_TRASH_PREFIX = ".trash-"


def step_dir_name(step: int) -> str:
    return f"step_{step:010d}"


def partial_dir_name(step: int, run_id: int, generation: int) -> str:
    return f".partial-step_{step:010d}-{run_id:016x}-g{generation}"


def rank_prefix(rank: int) -> str:
    return f"rank_{rank:05d}"


def fragment_name(rank: int) -> str:
    """Per-rank list of written files, merged into the manifest at commit."""
    return f"{rank_prefix(rank)}.files.json"


class Checksum:
    """Running checksum of a byte stream; the algorithms are cheap enough to run inline
    with the write (zlib's crc32/adler32 release the GIL on large buffers)."""

    def __init__(self, algo: str):
        self.algo = algo
        self.value: Optional[int] = {"crc32": 0, "adler32": 1, "none": None}[algo]

    def update(self, data) -> None:
        if self.algo == "crc32":
            self.value = zlib.crc32(data, self.value)
        elif self.algo == "adler32":
            self.value = zlib.adler32(data, self.value)


@dataclasses.dataclass
class FileEntry:
    name: str
    size: int
    checksum: Optional[int]

    def to_json(self) -> dict:
        return {"size": self.size, "checksum": self.checksum}


@dataclasses.dataclass
class Manifest:
    step: int
    world_size: int
    generation: int
    run_id: int
    checksum_algo: str
    ranks: Dict[int, List[str]]
    files: Dict[str, FileEntry]
    created: float = dataclasses.field(default_factory=time.time)
    format: int = FORMAT_VERSION

    def to_json(self) -> dict:
        return {
            "format": self.format,
            "step": self.step,
            "world_size": self.world_size,
            "generation": self.generation,
            "run_id": f"{self.run_id:016x}",
            "checksum_algo": self.checksum_algo,
            "created": self.created,
            "ranks": {str(r): names for r, names in sorted(self.ranks.items())},
            "files": {name: e.to_json() for name, e in sorted(self.files.items())},
        }

    @classmethod
    def from_json(cls, raw: dict, where: str) -> "Manifest":
        try:
            if raw["format"] != FORMAT_VERSION:
                raise CheckpointCorruptError(
                    f"{where}: manifest format {raw['format']!r} is not the supported "
                    f"version {FORMAT_VERSION}")
            files = {n: FileEntry(n, int(e["size"]), e["checksum"]) for n, e in raw["files"].items()}
            ranks = {int(r): list(names) for r, names in raw["ranks"].items()}
            for names in ranks.values():
                missing = [n for n in names if n not in files]
                if missing:
                    raise CheckpointCorruptError(f"{where}: manifest lists no entry for {missing}")
            return cls(step=int(raw["step"]), world_size=int(raw["world_size"]),
                       generation=int(raw["generation"]), run_id=int(raw["run_id"], 16),
                       checksum_algo=raw["checksum_algo"], ranks=ranks, files=files,
                       created=float(raw["created"]), format=raw["format"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointCorruptError(f"{where}: malformed manifest ({e!r})") from None


def read_manifest(ckpt_dir: str) -> Manifest:
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{ckpt_dir}: no {MANIFEST} (incomplete checkpoint)") from None
    except ValueError as e:
        raise CheckpointCorruptError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointCorruptError(f"{path}: manifest is not a JSON object")
    return Manifest.from_json(raw, path)


def check_sizes(ckpt_dir: str, manifest: Manifest, names: Iterable[str]) -> None:
    """Cheap structural check (existence and size) of the named files."""
    for name in names:
        path = os.path.join(ckpt_dir, name)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{path}: listed in the manifest but missing") from None
        if size != manifest.files[name].size:
            raise CheckpointCorruptError(
                f"{path}: size {size} != {manifest.files[name].size} in the manifest")


def verify_file(path: str, entry: FileEntry, algo: str, chunk_bytes: int = 16 << 20) -> None:
    """Read a whole file and compare its size and checksum with the manifest entry."""
    checksum = Checksum(algo)
    size = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while True:
                chunk = f.read(chunk_bytes)
                if not chunk:
                    break
                size += len(chunk)
                checksum.update(chunk)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path}: listed in the manifest but missing") from None
    check_entry(path, entry, size, checksum.value)


def check_entry(path: str, entry: FileEntry, size: int, checksum: Optional[int]) -> None:
    if size != entry.size:
        raise CheckpointCorruptError(f"{path}: size {size} != {entry.size} in the manifest")
    if entry.checksum is not None and checksum != entry.checksum:
        raise CheckpointCorruptError(
            f"{path}: checksum {checksum:#010x} != {entry.checksum:#010x} in the manifest")


def verify_checkpoint(ckpt_dir: str, ranks: Optional[Iterable[int]] = None) -> Manifest:
    """Full verification (every byte) of the given ranks' files, or of all files."""
    manifest = read_manifest(ckpt_dir)
    names = (manifest.files if ranks is None
             else [n for r in ranks for n in manifest.ranks.get(r, _missing_rank(ckpt_dir, r))])
    for name in names:
        verify_file(os.path.join(ckpt_dir, name), manifest.files[name], manifest.checksum_algo)
    return manifest


def _missing_rank(ckpt_dir: str, rank: int) -> List[str]:
    raise CheckpointCorruptError(f"{ckpt_dir}: the manifest has no files for rank {rank}")


def write_manifest(ckpt_dir: str, manifest: Manifest) -> None:
    durable.atomic_write_json(os.path.join(ckpt_dir, MANIFEST), manifest.to_json())


class CheckpointStore:
    """The committed checkpoints under one root directory, and their housekeeping."""

    def __init__(self, root_dir: str):
        self.root_dir = os.path.abspath(root_dir)

    def path(self, step: int) -> str:
        return os.path.join(self.root_dir, step_dir_name(step))

    def steps(self) -> List[int]:
        """Committed steps, oldest first (validity is checked when loading)."""
        try:
            names = os.listdir(self.root_dir)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, names) if m)

    def commit(self, partial_dir: str, step: int) -> str:
        """Publish a fully written partial directory as step_<step>, replacing an older one."""
        final = self.path(step)
        trash = None
        if os.path.lexists(final):
            trash = os.path.join(self.root_dir, f"{_TRASH_PREFIX}{step_dir_name(step)}-{os.getpid()}")
            os.rename(final, trash)
            logger.warning("checkpoint %s is being replaced by a new save of the same step", final)
        try:
            durable.commit_directory(partial_dir, final)
        except BaseException:
            if trash and not os.path.lexists(final):
                os.rename(trash, final)   # keep the older save of this step
            raise
        if trash:
            shutil.rmtree(trash, ignore_errors=True)
        return final

    def apply_retention(self, keep_last: int) -> List[int]:
        """Delete all but the newest `keep_last` committed checkpoints; returns deleted steps."""
        if keep_last <= 0:
            return []
        doomed = self.steps()[:-keep_last]
        for step in doomed:
            self.delete(step)
        return doomed

    def delete(self, step: int) -> None:
        """Remove a checkpoint: renamed first, so a crash midway leaves no half-deleted step."""
        final = self.path(step)
        trash = os.path.join(self.root_dir, f"{_TRASH_PREFIX}{step_dir_name(step)}-{os.getpid()}")
        try:
            os.rename(final, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def remove_leftovers(self, keep_run_id: int, keep_from_generation: int = 0) -> List[str]:
        """Remove partial directories of other runs (crashed saves) or of this run's older,
        abandoned generations, and trash left by an interrupted delete."""
        removed = []
        try:
            names = os.listdir(self.root_dir)
        except FileNotFoundError:
            return removed
        for name in names:
            m = _PARTIAL_DIR.match(name)
            stale = name.startswith(_TRASH_PREFIX) or (m is not None and (
                int(m.group(2), 16) != keep_run_id or int(m.group(3)) < keep_from_generation))
            if stale:
                shutil.rmtree(os.path.join(self.root_dir, name), ignore_errors=True)
                removed.append(name)
        return removed
