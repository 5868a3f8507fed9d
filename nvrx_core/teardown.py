"""The exit-time teardown rule: nothing gloo's worker threads still use is let go of while the
interpreter finalizes.

Why: gloo runs each collective on worker threads of its own, and ProcessGroupGloo's destructor
joins them. A worker that still holds a Python-owned object (the Python side of a tensor it
received, a DDP reducer's buffers) must take the GIL to let go of it. Once the interpreter has
begun finalizing, a thread that takes the GIL is ended with pthread_exit, whose unwinding
through a noexcept destructor calls std::terminate: "terminate called without an active
exception", exit code -6, after a job that had finished (or recovered and finished). And a
process group whose last reference drops on the main thread can deadlock there: the
destructor, holding the GIL, joins a worker that waits for the GIL.

So every part of the core that leaves gloo work behind at exit does one of two things:
- finish_before_exit(hook): the work that ends the workers' use (a checkpoint pipeline's
  saves in flight, the reaper thread destroying aborted process groups) runs from
  threading's exit hooks: after the main thread's code, before atexit's hooks and before
  the interpreter tears anything down (last registered, first run);
- keep_until_exit(obj): what cannot be finished in time (tensors gloo still held after a
  bounded wait, a finished script's globals with its DDP model and process groups in a
  worker that ends with os._exit) stays referenced for the rest of the process, so no gloo
  thread, and no destructor waiting for one, ever drops the last reference.

Torch-free on purpose: ft.warm_start uses it and is imported before the launcher imports torch.
"""

import atexit
import threading
from typing import Any, Callable, List

_KEPT_UNTIL_EXIT: List[Any] = []
"""Process-wide by necessity: what it holds must outlive every object of ours."""


def keep_until_exit(obj: Any) -> None:
    """Keep `obj` referenced until the process ends (see the module docstring)."""
    _KEPT_UNTIL_EXIT.append(obj)


def finish_before_exit(hook: Callable[..., Any], *args: Any) -> bool:
    """Run hook(*args) when the main thread's code has ended, while the interpreter is still whole.

    threading's exit hooks (CPython's threading._register_atexit; atexit where it is missing)
    run before atexit's and before concurrent.futures stops its pools taking work, which a
    hook registered after that module's import may still use. False when the interpreter is
    already exiting and nothing can be registered any more.
    """
    register = getattr(threading, "_register_atexit", atexit.register)
    try:
        register(hook, *args)
    except RuntimeError:
        return False
    return True
