"""Whatever a worker started ends with the worker's restart cycle.

Every worker is the leader of a process group of its own: torchrun starts script workers
in new sessions, and warm-started workers call setsid() first thing. What the training
script starts (DataLoader workers, its own fork server, a resource tracker) lands in that
group. torch's agent signals only the worker process, and only while it is alive, so the
children of a killed rank were left behind: persistent DataLoader workers wait for a
parent that is gone, and a forkserver's children outlived the job. The agent therefore
kills each worker's whole group when it stops the workers, and waits until the group is
empty before the next cycle starts.
"""

import logging
import os
import signal
import time
from typing import Callable, Dict, Iterable, List, Set, Tuple

logger = logging.getLogger("nvrx.ft.launcher")


def process_table() -> List[Tuple[int, int, int, str]]:
    """(pid, parent pid, process group, state letter) of every process (Linux /proc)."""
    table = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            table.append((int(entry), int(fields[1]), int(fields[2]), fields[0]))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return table


def live_group_members(pgids: Set[int]) -> Set[int]:
    """Pids of the live (not zombie) processes whose process group is in `pgids`."""
    return {pid for pid, _, pgrp, state in process_table() if pgrp in pgids and state not in ("Z", "X")}


def descendants(root: int) -> Set[int]:
    """Every process below `root`, at any depth."""
    children: Dict[int, List[int]] = {}
    for pid, ppid, _, _ in process_table():
        children.setdefault(ppid, []).append(pid)
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def kill_process_groups(
    pgids: Iterable[int],
    timeout: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> List[int]:
    """SIGKILL every process of each group; wait until none is alive, at most `timeout` seconds.

    Returns the groups that still had live members at the deadline (a process in
    uninterruptible sleep cannot die until its kernel call returns); they are logged.
    A group that no longer exists is skipped: its leader's pid cannot have been reused as a
    group id while the group existed, and the caller only passes groups of its own workers
    before starting new ones.
    """
    groups = {g for g in pgids if g > 1 and g != os.getpgrp()}
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = clock() + timeout
    alive = live_group_members(groups)
    while alive and clock() < deadline:
        sleep(0.01)
        alive = live_group_members(groups)
    if alive:
        logger.error("processes %s of stopped workers survived SIGKILL (uninterruptible sleep?)", sorted(alive))
    return sorted({_group_of(pid) for pid in alive})


def _group_of(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1
