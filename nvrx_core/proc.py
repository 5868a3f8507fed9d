"""What Linux /proc says about another process: the monitors' view of a rank they may kill.

Both monitors (ft_launcher's node monitor, the in-process Wrapper's monitor process) ask a
hung rank for a stack dump before killing it. On a loaded node the rank may not run for a
while after the dump signal is sent; a termination signal sent meanwhile is taken first
and the dump is lost. These let them wait for the rank to take the signal instead.
"""

import time
from typing import Callable

DUMP_WAIT_LIMIT = 5.0
"""Seconds a stack-dump signal may stay untaken before the rank is terminated anyway."""


def _status(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def alive(pid: int) -> bool:
    """Running or stopped (a zombie counts as gone)."""
    try:
        state = _status(pid).get("State", "").split()
    except OSError:
        return False
    return bool(state) and state[0] != "Z"


def signal_pending(pid: int, sig: int) -> bool:
    """Whether `sig` was sent to `pid` and not taken yet (False where unknown or gone).

    A stopped process (SIGSTOP) takes no signal, so for it nothing counts as pending.
    """
    try:
        fields = _status(pid)
        if fields.get("State", "").split()[:1] in (["T"], ["t"], ["Z"]):
            return False
        bit = 1 << (int(sig) - 1)
        return any(int(fields[name], 16) & bit for name in ("SigPnd", "ShdPnd") if name in fields)
    except (OSError, ValueError):
        return False


def wait_until_taken(pid: int, sig: int, grace: float, limit: float,
                     sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
    """Block until `pid` has taken `sig` and had `grace` seconds after that, at most `limit` seconds."""
    start = clock()
    sleep(grace)
    if not signal_pending(pid, sig):
        return
    while signal_pending(pid, sig) and clock() - start < limit:
        sleep(0.02)
    sleep(min(grace, max(0.0, limit - (clock() - start))))
