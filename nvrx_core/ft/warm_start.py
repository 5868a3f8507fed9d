"""Warm worker start: restarted workers fork from a process that already imported torch.

A restart's cost is dominated by new interpreters starting and importing torch (about 2 s
here, more on a loaded node), paid again on every restart. ft_launcher instead runs the
training script through torch.distributed.elastic's function-entrypoint path with the
"forkserver" start method, and preloads torch into the fork server once: every (re)start
then forks a fresh child of that server (a clean interpreter state that has only imported
torch and nvrx_core) and runs the script in it exactly as `python [-m] target args` would.
The fork server never initialises CUDA, so children are free to.
"""

import json
import multiprocessing
import os
import runpy
import shutil
import signal
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from nvrx_core.ft import forked_server
from nvrx_core.ft.respawn_marker import LAUNCHER_POLICY_ENV, RESPAWN_POLICY
from nvrx_core.signals import STOP_REQUEST_SIGNALS
from nvrx_core.teardown import keep_until_exit

# fork_server_signals first: the server ignores a job-wide stop signal from then on (its docstring).
# torch._dynamo: DistributedDataParallel (and torch.compile) import it on first use, ~1.7 s.
PRELOAD = ("nvrx_core.ft.fork_server_signals", "torch", "torch.distributed", "torch._dynamo", "nvrx_core.ft.client")

RESPAWN_PRELOAD = ("nvrx_core.inprocess",)
"""Imported once more under --ft-restart-policy respawn-rank: its workers all run the Wrapper."""
_RESTART_POLICY_FLAGS = ("--ft-restart-policy", "--ft-restart_policy", "--restart-policy", "--restart_policy")

PYTHON_EXEC_ENV = "PYTHON_EXEC"
"""torchrun's choice of interpreter for the script (default: its own)."""

_SERVER_ENV: List[Dict[str, str]] = []
"""The environment the fork server started with (its children's, before torch adds each
worker's own variables): multiprocessing keeps one fork server per process, so this is per
process too."""


def start_fork_server(preload: Sequence[str] = PRELOAD) -> None:
    """Start the fork server now (once per process), so its imports overlap with the launcher's;
    a process that imported torch already forks it instead (`forked_server`)."""
    from multiprocessing import forkserver

    if _SERVER_ENV:
        forkserver.ensure_running()  # restarts a server that died
        return
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    _SERVER_ENV.append(dict(os.environ))
    if forked_server.can_fork_server():
        with forked_server.server_forked_from_here():
            forkserver.ensure_running()
    else:
        forkserver.ensure_running()


def start_early(argv: Sequence[str]) -> None:
    """Start the fork server before ft_launcher imports torch, when its command line wants a
    warm start: the server's imports (about 2 s) then run beside the launcher's instead of
    after them. Only a clear "no" skips it (--no-warm-start, --no-python, help); the launcher
    checks everything else and starts the server itself if this did not."""
    preload = early_preload(argv)
    if preload is not None:
        start_fork_server(preload)


def early_preload(argv: Sequence[str]) -> Optional[List[str]]:
    """The fork server's preload list for this command line; None where it wants no warm start."""
    if any(a in ("--no-warm-start", "--no-python", "--no_python", "-h", "--help") for a in argv):
        return None
    if foreign_interpreter() is not None:
        return None
    extra = [m.strip() for m in (_flag_value(argv, ("--warm-start-preload",)) or "").split(",") if m.strip()]
    if (_flag_value(argv, _RESTART_POLICY_FLAGS) or os.environ.get(LAUNCHER_POLICY_ENV)) == RESPAWN_POLICY:
        extra += RESPAWN_PRELOAD
    return [*PRELOAD, *extra]


def _flag_value(argv: Sequence[str], names: Sequence[str]) -> Optional[str]:
    """The last value given to any of `names` (`--flag value` or `--flag=value`), or None."""
    found = None
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            found = argv[i + 1]
        elif "=" in arg and arg.split("=", 1)[0] in names:
            found = arg.split("=", 1)[1]
    return found


def foreign_interpreter(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """torchrun's $PYTHON_EXEC, when it names an interpreter other than the launcher's own.

    torchrun runs the script with that interpreter; a warm-started worker is a fork of the
    launcher's interpreter and could not honour it, so such a job starts cold. Paths are
    compared as written, not resolved: a venv's python links to its base interpreter, which
    would run the script without the venv's packages."""
    named = environ.get(PYTHON_EXEC_ENV)
    if not named:
        return None
    found = shutil.which(named) or named
    if os.path.normpath(os.path.abspath(found)) == os.path.normpath(os.path.abspath(sys.executable)):
        return None
    return named


def environment_since_server_start() -> Dict[str, List[Optional[str]]]:
    """Variables the launcher set or removed after the fork server started: name -> [the
    server's value, the launcher's value] (None: unset). Workers apply them (run_target),
    so a warm-started worker sees the environment a cold-started one would."""
    return environment_changes(_SERVER_ENV[0], os.environ) if _SERVER_ENV else {}


def environment_changes(before: Mapping[str, str], now: Mapping[str, str]) -> Dict[str, List[Optional[str]]]:
    return {k: [before.get(k), now.get(k)] for k in set(before) | set(now) if before.get(k) != now.get(k)}


def apply_launcher_environment(changes: Dict[str, List[Optional[str]]]) -> None:
    """Apply environment_since_server_start() in a worker, except where torch already set a
    variable for this worker (its value then differs from the server's)."""
    for name, (server_value, launcher_value) in changes.items():
        if os.environ.get(name) != server_value:
            continue
        if launcher_value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = launcher_value


def split_python_command(cmd_args: List[str]) -> Tuple[str, List[str]]:
    """torch's ['-u', ('-m'), target, *args] for `python ...` -> (kind, [target, *args])."""
    args = [a for a in cmd_args if a != "-u"]
    if args and args[0] == "-m":
        return "module", args[1:]
    return "script", args


def become_like_a_fresh_interpreter() -> None:
    """Undo what being a fork server's child changed, so user code sees what `python train.py`
    under torchrun would show it.

    - Its own session and process group, as torchrun gives each worker: whatever the script
      starts (DataLoader workers, its own fork servers) is in the worker's group, which the
      agent kills as a whole when the cycle ends, even after the worker itself died.
    - The platform's default start method, unset: a forkserver child inherits "forkserver",
      so a DataLoader with workers would re-import a script without a main guard in a new
      fork server (multiprocessing's "bootstrapping phase" error), its workers would watch the
      wrong parent and outlive a killed rank, and `set_start_method(...)` would raise.
    - A main process's name, default signal dispositions (a forked child inherits the
      server's: it ignores every stop request, see fork_server_signals) and `-u` streams.
    """
    try:
        os.setsid()
    except PermissionError:  # already a session leader
        pass
    multiprocessing.set_start_method(None, force=True)
    multiprocessing.current_process().name = "MainProcess"
    for sig in STOP_REQUEST_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)


def run_target(environment: str, kind: str, target: str, *argv: str) -> None:
    """Entry point of a warm-started worker: behave like `python -u [-m] target argv`, in the
    environment the launcher had when it started the workers (`environment`: JSON of
    environment_since_server_start()).

    The finished script's globals (its DDP model, optimizer, process groups) are kept until the
    worker exits (nvrx_core.teardown): freed on the main thread right after the last collective,
    a DDP reducer's destructor can wait for a gloo worker thread that waits for the GIL the
    destructor holds, and the agent never collects the worker's result. The worker ends with
    os._exit (multiprocessing), so they are never destroyed at all."""
    apply_launcher_environment(json.loads(environment))
    become_like_a_fresh_interpreter()
    try:
        if kind == "module":
            sys.argv = [target, *argv]
            sys.path.insert(0, os.getcwd())
            keep_until_exit(runpy.run_module(target, run_name="__main__", alter_sys=True))
        else:
            sys.argv = [target, *argv]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            keep_until_exit(runpy.run_path(target, run_name="__main__"))
    except SystemExit as e:
        keep_until_exit(e)  # its traceback holds the script's frames and globals
        # sys.exit(0) is success; torch's function entrypoint path expects a plain return.
        if e.code not in (None, 0):
            raise
    except BaseException:
        # `python train.py` prints an uncaught exception's traceback on stderr; torch's
        # function entrypoint would only hand it to the agent's error queue.
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        raise
