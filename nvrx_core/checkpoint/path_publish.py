"""Publishing a checkpoint directory under a name the caller chose, atomically, even when
that name already holds a checkpoint.

Frameworks name checkpoints themselves (Lightning: `.../last.ckpt`, saved again and again)
and find them again by listing the directory. A save is written into a hidden partial
directory next to its target and becomes visible only when it is complete:

    <dir>/last.ckpt/                                  the committed checkpoint (manifest inside)
    <dir>/.last.ckpt.nvrx-partial-<run>-g<gen>/       a save in progress, or a crashed one
    <dir>/.last.ckpt.nvrx-aside-<run>-g<gen>/         the older copy, only during a fallback swap
    <dir>/.last.ckpt.nvrx-trash-<run>-g<gen>/         a checkpoint being deleted
    <dir>/.nvrx-writer-<run>.lock                      flock held while run <run> writes here

Hidden names never end in the target's extension, so a lookup such as Lightning's
"last*.ckpt" never sees them. A new target is published by rename. An existing one is
swapped with the new directory in one renameat2(RENAME_EXCHANGE) call, so at every instant
the name holds either the complete old checkpoint or the complete new one; where the
filesystem or libc lacks it (non-Linux, some network filesystems) the old one is renamed
aside first and a crash between the two renames leaves it under the aside name, which
`sweep_leftovers` renames back. The sweep touches only runs whose writer lock is free
(the process ended: the kernel released its flock), never another live writer's files.
"""

import ctypes
import errno
import fcntl
import functools
import logging
import os
import re
import shutil
from typing import Callable, List, Optional

from nvrx_core import durable

logger = logging.getLogger("nvrx.checkpoint")

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
_HIDDEN = re.compile(r"^\.(?P<target>.+)\.nvrx-(?P<kind>partial|aside|trash)-"
                     r"(?P<run>[0-9a-f]{16})-g(?P<gen>\d+)$")
_LOCK = re.compile(r"^\.nvrx-writer-(?P<run>[0-9a-f]{16})\.lock(\.\d+\.tmp)?$")


def hidden_name(target: str, kind: str, run_id: int, generation: int) -> str:
    """Path of a hidden sibling of `target` (kind: partial, aside or trash)."""
    directory, base = os.path.split(target)
    return os.path.join(directory, f".{base}.nvrx-{kind}-{run_id:016x}-g{generation}")


@functools.lru_cache(maxsize=1)
def _renameat2() -> Optional[Callable[..., int]]:
    """libc's renameat2, or None where libc has none (glibc < 2.28, musl, macOS)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def exchange(first: str, second: str) -> bool:
    """Swap two existing paths in one atomic step; False where that is not supported here."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        logger.debug("renameat2(RENAME_EXCHANGE) unsupported for %s (%s); renaming aside",
                     second, os.strerror(code))
        return False
    raise OSError(code, os.strerror(code), first, None, second)


def publish(partial: str, target: str, run_id: int, generation: int) -> bool:
    """Make the fully written (files fsynced) directory `partial` visible as `target`.

    Returns True if it replaced an older file, directory or symlink at `target`, which is
    then deleted. A crash at any moment leaves `target` complete: old or new.
    """
    parent = os.path.dirname(target)
    if not os.path.lexists(target):
        durable.commit_directory(partial, target)
        return False
    durable.fsync_dir(partial)
    if exchange(partial, target):
        durable.fsync_dir(parent)
        remove_entry(partial)            # now holds the older checkpoint
        return True
    aside = hidden_name(target, "aside", run_id, generation)
    os.rename(target, aside)
    try:
        os.rename(partial, target)
    except BaseException:
        os.rename(aside, target)         # keep the older checkpoint under its name
        raise
    durable.fsync_dir(parent)
    remove_entry(aside)
    return True


def remove_entry(path: str) -> None:
    """Delete a file, a symlink (never what it points to) or a directory tree."""
    if os.path.islink(path) or not os.path.isdir(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    shutil.rmtree(path, ignore_errors=True)


def remove_checkpoint(target: str, run_id: int, number: int = 0,
                      delete: Callable[[str], None] = remove_entry) -> bool:
    """Delete the checkpoint at `target`; returns whether anything was there.

    A symlink is unlinked (never what it points to). A file or directory is first renamed
    to a hidden trash name, so the name is gone at once and a crash never leaves a
    half-deleted checkpoint under it; `delete(trash)` then frees the bytes (freeing a
    gigabyte of page cache and extents takes ~0.2 s: a caller may hand it to a thread).
    """
    if not os.path.lexists(target):
        return False
    if os.path.islink(target):
        os.unlink(target)
        return True
    trash = hidden_name(target, "trash", run_id, number)
    if os.path.lexists(trash):
        remove_entry(trash)              # left by an interrupted delete
    os.rename(target, trash)
    durable.fsync_dir(os.path.dirname(target))
    delete(trash)
    return True


def _lock_path(directory: str, run_id: int) -> str:
    return os.path.join(directory, f".nvrx-writer-{run_id:016x}.lock")


def hold_writer_lock(directory: str, run_id: int) -> Optional[int]:
    """Mark run `run_id` as writing in `directory` until release_writer_lock (or the
    process ends). The lock file appears only already locked (created under a temporary
    name, then renamed), so a sweep never mistakes a starting writer for a dead one.
    Returns the descriptor, or None where the filesystem has no flock (then a sweep may
    remove this run's files: one writer per directory)."""
    temporary = _lock_path(directory, run_id) + f".{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(temporary, _lock_path(directory, run_id))
    except OSError as e:
        os.close(fd)
        remove_entry(temporary)
        logger.debug("no writer lock in %s (%r): a leftover sweep cannot tell this run is alive",
                     directory, e)
        return None
    return fd


def release_writer_lock(fd: Optional[int], directory: str, run_id: int) -> None:
    if fd is None:
        return
    remove_entry(_lock_path(directory, run_id))
    os.close(fd)


def _held(path: str) -> bool:
    """True if someone holds the lock file at `path`; a free one (its run ended) is removed."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False            # no flock here: cannot tell, treat as ended
    finally:
        os.close(fd)
    remove_entry(path)
    return False


def sweep_leftovers(directory: str, keep_run_id: int) -> List[str]:
    """Clean up after crashed saves in `directory`, for every run other than `keep_run_id`
    that is not alive (see hold_writer_lock): partial directories and trash are removed;
    an aside copy whose target is missing (a crash in the middle of a fallback swap) is
    renamed back, otherwise removed. Returns the names handled."""
    handled = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return handled
    alive = {}
    for name in sorted(names):
        lock = _LOCK.match(name)
        if lock is not None:
            if int(lock.group("run"), 16) != keep_run_id and not _held(os.path.join(directory, name)):
                handled.append(name)
            continue
        match = _HIDDEN.match(name)
        if match is None or int(match.group("run"), 16) == keep_run_id:
            continue
        run = int(match.group("run"), 16)
        if run not in alive:
            alive[run] = _held(_lock_path(directory, run))
        if alive[run]:
            continue
        path = os.path.join(directory, name)
        target = os.path.join(directory, match.group("target"))
        if match.group("kind") == "aside" and not os.path.lexists(target):
            os.rename(path, target)
            logger.warning("restored %s from an interrupted replacement", target)
        else:
            remove_entry(path)
        handled.append(name)
    return handled
