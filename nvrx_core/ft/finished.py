"""The finished flag: how a completed job tells its scheduler-level retries to stop.

Schedulers (and NeMo-Run's FaultTolerancePlugin) resubmit a job until it stops failing.
When training completes, the job writes the file named by FAULT_TOL_FINISHED_FLAG_FILE;
ft_launcher, started again by a later submission, finds it and exits 0 at once.
"""

import os
from typing import Optional

from nvrx_core.durable import atomic_write_bytes

FINISHED_FLAG_ENV = "FAULT_TOL_FINISHED_FLAG_FILE"


def finished_flag_path() -> Optional[str]:
    return os.environ.get(FINISHED_FLAG_ENV) or None


def is_finished() -> bool:
    path = finished_flag_path()
    return bool(path) and os.path.exists(path)


def write_finished_flag(path: Optional[str] = None) -> Optional[str]:
    """Atomically create the flag (from the argument or the env var); return its path, if any."""
    path = path or finished_flag_path()
    if path:
        atomic_write_bytes(path, b"finished\n")
    return path
