"""Running ft_launcher as a real subprocess in tests, and reading what it left behind."""

import os
import signal
import subprocess
import sys
from typing import List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "scripts")


def run_launcher(args: List[str], timeout: float = 180, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run `ft_launcher ARGS` to completion; kill its whole process group if it overruns."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    full_env.pop("FAULT_TOL_FINISHED_FLAG_FILE", None)
    full_env.pop("NVRX_EVENTS_FILE", None)
    full_env.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "nvrx_core.ft.launcher", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"ft_launcher did not finish within {timeout} s; output:\n{out[-5000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # any straggling worker or monitor
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def kinds(events: List[dict], kind: str) -> List[dict]:
    return [e for e in events if e["kind"] == kind]
