"""Interrupting the main thread, and telling whether it is making progress at all.

Interruption: a signal (SIGUSR1 by default) sent to the main thread, whose Python handler
raises RestartRequested. A signal, rather than only an asynchronous exception, because it
also breaks blocking system calls (time.sleep, select, socket waits) that an asynchronous
exception would wait out. A main thread blocked inside a collective is released by the
abort (connections shut down), and the pending handler raises as soon as it returns.
The handler only raises inside the wrapped function: MainThreadInterrupter.call() arms it
around the call, and a handler that runs in call()'s own frame (the function has not
started or has already returned) or while disarming only notes the request. The
function's return can race with a request (the signal is taken at the next bytecode,
which may be the Wrapper's); raised there, it would escape the Wrapper as a crash. How
the iteration then ends (completion or restart) is settled through the store, the same
on every rank. Inside `atomic()` the handler waits until the block ends.

Progress: Py_AddPendingCall schedules a tiny callback that only the main thread runs,
between two bytecodes. If it has not run for N seconds, the main thread has not
executed Python for N seconds: it is stuck in a C call (GIL free or not).
"""

import contextlib
import ctypes
import signal
import threading
import time
from typing import Callable, Iterator, Optional

from nvrx_core.inprocess.errors import RestartRequested
from nvrx_core.signals import SignalClaim, default_registry

_PENDING_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class MainThreadInterrupter:
    """Raises RestartRequested in the main thread on request from any thread."""

    def __init__(self, signum: int):
        self.signum = signum
        self._main_ident = threading.main_thread().ident
        self._claim: Optional[SignalClaim] = None
        self._armed = False
        self._atomic_depth = 0
        self._deferred = False
        self._reason = ""
        self.late_requests = 0
        """Requests taken outside the function (before it started or after it returned)."""

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the in-process Wrapper must run in the main thread (signals are delivered there)")
        # One owner per signal: a conflict (e.g. preemption configured with SIGUSR1) is
        # refused here with both owners named, instead of one silently replacing the other.
        self._claim = default_registry().claim(self.signum, "inprocess.interrupt", self._handle)

    def uninstall(self) -> None:
        if self._claim is not None:
            self._claim.release()  # the disposition from before install() comes back
            self._claim = None

    @property
    def armed(self) -> bool:
        return self._armed

    def arm(self) -> None:
        self._deferred, self._reason = False, ""
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def call(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs) with interruptions armed; none is raised outside fn's own frames."""
        self.arm()
        try:
            return fn(*args, **kwargs)
        finally:
            self.disarm()

    def request(self, reason: str) -> None:
        """Interrupt the main thread if it is in the wrapped function (callable from any thread)."""
        self._reason = reason
        if self._armed:
            signal.pthread_kill(self._main_ident, self.signum)

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block that an interruption does not break into; it is raised when the block ends."""
        self._atomic_depth += 1
        try:
            yield
        finally:
            self._atomic_depth -= 1
            if self._atomic_depth == 0 and self._deferred and self._armed:
                self._deferred = False
                raise RestartRequested(self._reason)

    def _handle(self, signum, frame) -> None:
        if not self._armed:
            return
        if frame is not None and frame.f_code in _OWN_FRAMES:  # fn has not started, or has returned
            self.late_requests += 1
            return
        if self._atomic_depth:
            self._deferred = True
            return
        raise RestartRequested(self._reason)


_OWN_FRAMES = frozenset(f.__code__ for f in (MainThreadInterrupter.call, MainThreadInterrupter.arm,
                                             MainThreadInterrupter.disarm))


class MainThreadProgress:
    """Last time the main thread executed Python code (monotonic seconds).

    poke() is called periodically from another thread; at most one callback is queued at
    a time (the interpreter's queue of pending calls is small and shared).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.last = clock()
        self._outstanding = False
        self._callback = _PENDING_CALLBACK(self._tick)  # keep a reference: the C side holds a raw pointer
        self._add = ctypes.pythonapi.Py_AddPendingCall
        self._add.argtypes = [_PENDING_CALLBACK, ctypes.c_void_p]
        self._add.restype = ctypes.c_int

    def _tick(self, _arg) -> int:
        self.last = self._clock()
        self._outstanding = False
        return 0

    def poke(self) -> None:
        if self._outstanding:
            return
        self._outstanding = True
        if self._add(self._callback, None) != 0:  # queue full: try again next time
            self._outstanding = False

    def touch(self) -> None:
        """Count now as progress (the main thread calls this itself, e.g. at a new iteration)."""
        self.last = self._clock()

    def idle_for(self, now: Optional[float] = None) -> float:
        return (self._clock() if now is None else now) - self.last
