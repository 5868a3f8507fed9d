"""multiprocessing's fork server started by forking this process, where torch is imported already.

ft_launcher's fork server is normally a new interpreter that imports torch and torch._dynamo
(about 5 s of CPU), started before the launcher imports torch so that the two imports run side
by side. A launcher whose process imported torch already (forked from a warm parent, as the test
suite runs it, or called from Python) would pay those seconds again for nothing. Here the server
is a fork of the launcher instead, running the same `forkserver.main` call the new interpreter
would run, with the same descriptors and nothing else: every other descriptor is closed (an
exec would have), Python's signal handlers are the defaults, and the objects it inherited are
frozen out of the cycle collector, so none is finalised later and closes a descriptor number
that the server has reused.

Only the start differs: the server, its children and how they reach the launcher are
multiprocessing's own. Where this Python's multiprocessing is not the one this was written for
(no `util.spawnv_passfds`, or the command is not `-c CODE`), the server starts as a new
interpreter.
"""

import contextlib
import gc
import os
import signal
import sys
import threading
import traceback
from multiprocessing import util
from typing import Iterator, Sequence

_FD_LIMIT = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1 << 16
_ORIGINAL = getattr(util, "spawnv_passfds", None)


def can_fork_server() -> bool:
    """Only a process that holds torch and runs one thread: a fork copies no other thread, and
    one of them could hold a lock (logging's, the import lock) the server then waits on forever."""
    return ("torch" in sys.modules and threading.active_count() == 1
            and callable(getattr(util, "spawnv_passfds", None)))


@contextlib.contextmanager
def server_forked_from_here() -> Iterator[None]:
    """Within this block, multiprocessing's start of a fork server forks this process."""
    original = util.spawnv_passfds
    util.spawnv_passfds = _fork_passfds
    try:
        yield
    finally:
        util.spawnv_passfds = original


def _fork_passfds(path: str, args: Sequence[str], passfds: Sequence[int]) -> int:
    if "-c" not in args[:-1]:
        return _ORIGINAL(path, args, passfds)
    code = args[list(args).index("-c") + 1]
    for stream in (sys.stdout, sys.stderr):
        stream.flush()                          # else the server's children would write it again
    gc.collect()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        _like_a_new_interpreter(passfds)
        exec(compile(code, "<fork server>", "exec"), {"__name__": "__main__"})
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)


def _like_a_new_interpreter(passfds: Sequence[int]) -> None:
    gc.freeze()
    keep = sorted({0, 1, 2, *passfds})
    for low, high in zip(keep, [*keep[1:], _FD_LIMIT]):
        os.closerange(low + 1, high)
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)

