"""Durable writes: the single helper every state file and checkpoint goes through.

A reader must never observe a half-written file, even if the writer is killed mid-write
or the machine loses power: write to a temp file in the same directory, fsync it,
os.replace() it over the target, then fsync the directory so the rename itself is durable.
"""

import contextlib
import json
import os
import tempfile
from typing import Any, BinaryIO, Callable, Iterator


def fsync_dir(path: str) -> None:
    """Make a rename/creation inside directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str, mode: int = 0o644) -> Iterator[BinaryIO]:
    """Yield a binary file; on clean exit it atomically becomes `path`, on error it vanishes."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def atomic_write_bytes(path: str, data: bytes, mode: int = 0o644) -> None:
    with atomic_file(path, mode) as f:
        f.write(data)


def atomic_write_json(path: str, obj: Any, mode: int = 0o644) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=True).encode() + b"\n", mode)


def atomic_write_with(path: str, writer: Callable[[BinaryIO], None], mode: int = 0o644) -> None:
    """Atomically create `path` from whatever `writer(file)` writes (e.g. torch.save)."""
    with atomic_file(path, mode) as f:
        writer(f)


def commit_directory(tmp_dir: str, final_dir: str) -> None:
    """Atomically publish a fully written directory under its final name.

    The directory's entries are made durable first, then it is renamed, then the parent
    is fsynced so the rename survives power loss. `final_dir` must not exist: a rename
    over an existing non-empty directory is not atomic, so the caller decides what to do
    with an older one. The files inside must already be fsynced.
    """
    if os.path.lexists(final_dir):
        raise FileExistsError(f"cannot commit {tmp_dir!r}: {final_dir!r} already exists")
    fsync_dir(tmp_dir)
    os.rename(tmp_dir, final_dir)
    fsync_dir(os.path.dirname(os.path.abspath(final_dir)))
