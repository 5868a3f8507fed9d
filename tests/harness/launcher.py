"""Running ft_launcher as a real process in tests, and reading what it left behind.

The one launcher runner of the tests (`run_launcher`, `warm_popen`), with the process-tree
kill every test uses for what it started (`kill_tree`).
"""

import json
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional

from nvrx_core.ft.process_groups import descendants
import warm_python

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "tests", "scripts")


def run_launcher(args: List[str], timeout: float = 180, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run `ft_launcher ARGS` to completion; kill its whole process group if it overruns."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    full_env.pop("FAULT_TOL_FINISHED_FLAG_FILE", None)
    full_env.pop("NVRX_EVENTS_FILE", None)
    full_env.update(env or {})
    # the launcher forked from a process that imported it already (tests/warm_python.py): 2 s of
    # CPU less per run; the tests that start the command cold (test_ft_safety_net, test_ft_warm_start,
    # test_nemo_run_jobs ...) keep its own start-up covered
    proc = warm_python.popen(["-m", "nvrx_core.ft.command", *args], stdout=warm_python.PIPE,
                             stderr=warm_python.STDOUT, text=True, env=full_env, start_new_session=True,
                             preload=warm_python.LAUNCHER)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _dump_workers(proc.pid)
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"ft_launcher did not finish within {timeout} s; output:\n{out[-5000:]}")
    finally:
        kill_tree(proc.pid)  # any straggling worker or monitor
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def warm_popen(argv: List[str], **kwargs) -> warm_python.WarmProcess:
    """subprocess.Popen([sys.executable, ...]) of an ft_launcher command line, forked from a
    process that imported the launcher already (nvrx_core.demo.nodes.LocalCluster's `popen`)."""
    assert argv[0] == sys.executable, argv
    return warm_python.popen(argv[1:], preload=warm_python.LAUNCHER, **kwargs)


def start_ticks(pid: int) -> Optional[int]:
    """When `pid` started, in clock ticks since boot: with the pid, it names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except OSError:
        return None


def alive(pid: int, started: int) -> bool:
    """`pid` is still the process that started at `started` (start_ticks), and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X") and int(fields[19]) == started


def kill_tree(root: int) -> None:
    """SIGKILL `root`'s process group and every descendant (workers run in sessions of their own)."""
    for pid in descendants(root):
        _quietly(os.kill, pid, signal.SIGKILL)
    _quietly(os.killpg, root, signal.SIGKILL)


def _quietly(kill, pid: int, sig: int) -> None:
    try:
        kill(pid, sig)
    except ProcessLookupError:
        pass


def _dump_workers(launcher_pid: int) -> None:
    """Before killing an overrun job: ask its workers' faulthandler (SIGUSR2) for their stacks,
    so the failure shows where they were. Only the workers (forked by the warm-start fork
    server): the launcher and its monitor have no handler for it."""
    try:
        servers = subprocess.run(["pgrep", "-P", str(launcher_pid), "-f", "forkserver"], capture_output=True,
                                 text=True).stdout.split()
    except OSError:  # no pgrep: no dump
        return
    for server in servers:
        for pid in descendants(int(server)):
            _quietly(os.kill, pid, signal.SIGUSR2)
    time.sleep(2.0)  # a failure path only: time for the dumps to reach the pipe


def kinds(events: List[dict], kind: str) -> List[dict]:
    return [e for e in events if e["kind"] == kind]


def preempt_progress(out: str, rank: int) -> Optional[dict]:
    """What tests/scripts/preempt_job.py's rank last wrote of its progress (step, pid), or None."""
    try:
        with open(os.path.join(out, f"progress.rank{rank}")) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None
