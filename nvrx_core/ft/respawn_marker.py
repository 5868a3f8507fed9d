"""How ft_launcher learns that a worker runs the in-process Wrapper (respawn-rank's precondition).

Under `--ft-restart-policy respawn-rank` the launcher replaces a dead worker with a new
process of the same rank, and the others go on. Only a worker inside the Wrapper can take a
replacement back into its job; one that trains without it leaves its peers in a broken
collective, so its death must restart every rank. The Wrapper announces itself with a file
named after its global rank holding its pid, once it has joined the in-process coordination;
the launcher reads it when the worker dies. A file left by a process that its replacement
succeeded names another pid, so it never vouches for a worker that did not announce itself.

Torch-free and stdlib-only (the Wrapper imports it, and so may the launcher's early command).
"""

import os
from typing import Optional

from nvrx_core.durable import atomic_write_bytes

RESTART_POLICY_ENV = "NVRX_RESTART_POLICY"
"""`respawn-rank` when the launcher replaces dead ranks (set in every worker's environment)."""
LAUNCHER_POLICY_ENV = "NVRX_FT_RESTART_POLICY"
"""ft_launcher's --ft-restart-policy when the flag is not given (NeMo-Run's FaultTolerancePlugin
sets it: NeMo-Run writes the launcher's command line itself)."""
RESPAWN_POLICY = "respawn-rank"
RESPAWN_DIR_ENV = "NVRX_RESPAWN_DIR"
"""The launcher's private (0700) directory of announcements."""
INCARNATION_ENV = "NVRX_RANK_INCARNATION"
"""0 for a rank's first process in a restart cycle, n for its n-th replacement."""


def marker_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{int(rank)}")


def announce_wrapper(directory: str, rank: int, pid: int) -> None:
    """Written by the Wrapper once it has joined its job: `pid` (decimal) as the file of global
    rank `rank`, replaced whole (temp file, os.replace), never seen half-written."""
    atomic_write_bytes(marker_path(directory, rank), str(int(pid)).encode(), mode=0o600)


def wrapper_pid(directory: str, rank: int) -> Optional[int]:
    """The pid that last announced itself for `rank` (None: none did, or the file is unreadable)."""
    try:
        with open(marker_path(directory, rank)) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
