"""Running one benchmark job as its own process group, and leaving nothing of it behind."""

import os
import signal
import subprocess
from typing import IO, List, Optional


def run_group(cmd: List[str], log: IO, env: dict, limit: float, cwd: Optional[str] = None) -> Optional[int]:
    """Run `cmd` with its output in `log`; its exit code, or None if it ran past `limit` seconds.

    The whole process group is killed afterwards either way: a launcher's workers, its monitor
    or a hung rank must not outlive the run and skew the next one.
    """
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=cwd)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        return None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
