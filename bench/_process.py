"""Running one benchmark job as its own process group, and leaving nothing of it behind."""

import os
import signal
import subprocess
from typing import IO, List, Optional

from nvrx_core.ft.process_groups import descendants


def run_group(cmd: List[str], log: IO, env: dict, limit: float, cwd: Optional[str] = None) -> Optional[int]:
    """Run `cmd` with its output in `log`; its exit code, or None if it ran past `limit` seconds.

    Everything it started is killed afterwards either way: a launcher's workers, its monitor
    or a hung rank must not outlive the run and skew the next one. torchrun starts workers
    in sessions of their own, so killing the process group is not enough: descendants are
    collected (while the tree still exists) and killed one by one.
    """
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=cwd)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        return None
    finally:
        leftovers = descendants(proc.pid)
        _quietly(os.killpg, proc.pid, signal.SIGKILL)
        for pid in leftovers:
            _quietly(os.kill, pid, signal.SIGKILL)
        proc.wait()


def _quietly(kill, pid: int, sig: int) -> None:
    try:
        kill(pid, sig)
    except ProcessLookupError:
        pass
