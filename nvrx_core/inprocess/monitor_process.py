"""The hard-timeout monitor: a separate process that kills a rank making no progress at all.

A rank stuck in a C call that holds the GIL cannot interrupt itself: no thread of it can
run. So each rank forks a small monitor process when the Wrapper starts. The rank's
ProgressReporter thread, which never touches the store, writes "progress <t>" lines (on
the shared CLOCK_MONOTONIC) into a pipe; the monitor process:
- when the rank's last progress is older than hard_timeout: declares it terminated in
  the store, asks faulthandler for a stack dump (stack_dump_signal), then kills it
  (termination_signal and SIGCONT, then SIGKILL after termination_grace): the node
  monitor's sequence, nvrx_core.hang_kill, through a pidfd opened on the rank at start;
- declares the rank terminated (cause "exited") when it dies on its own: the pipe hits
  end-of-file, or the monitor's parent changes (the rank was its parent);
- exits quietly on "stop", when the rank leaves the Wrapper normally.

Nothing on that path waits for the store. Progress travels through the pipe, so a store
that stops answering cannot starve the monitor of it. The declaration runs in a thread of
the monitor process: the kill waits for it at most declare_wait (0.5 s), so that peers
normally learn of the kill before it happens, and afterwards up to declare_timeout, so
that they learn of it once the store answers again (until then, their heartbeat watch
notices the silence).

What counts as progress: while the wrapped function runs, the main thread's last Python
bytecode (a C call holding or releasing the GIL longer than hard_timeout is a hang the
soft timeout could not end). While the Wrapper's own code runs (restart barrier, waiting
for the other ranks), its store requests can wait for a stalled store; there the reporter
vouches for the rank as long as its own thread runs (so a C call holding the GIL is still
caught) for up to machinery_allowance (barrier_timeout, the longest the Wrapper means to
wait for its peers) past the main thread's last bytecode. A store that never answers
again thus ends in the hard timeout, barrier_timeout later than a hang would.

Forked rather than spawned: a fresh interpreter would import torch again (seconds of CPU
per rank, on every start); the child only runs plain Python and, when it must declare a
termination, opens its own store client.
"""

import dataclasses
import logging
import os
import selectors
import signal
import threading
import time
from typing import Callable, Optional

from nvrx_core import events as ev
from nvrx_core import hang_kill
from nvrx_core.proc import ProcessHandle
from nvrx_core.inprocess.records import Cause

logger = logging.getLogger("nvrx.inprocess.monitor")


@dataclasses.dataclass(frozen=True)
class MonitorSettings:
    rank: int
    hard_timeout: float
    termination_grace: float
    termination_signal: int
    interval: float
    log_path: Optional[str] = None
    stack_dump_signal: Optional[int] = None
    stack_dump_grace: float = 0.3
    declare_wait: float = 0.5
    """Longest delay of a kill for the declaration to reach the store first."""
    declare_timeout: float = 30.0
    """How long the monitor process keeps trying to declare a rank it killed or saw die."""


class MonitorProcess:
    """The rank's handle on its monitor process."""

    def __init__(self, settings: MonitorSettings, declare_terminated: Callable[[Cause, str], None]):
        self.settings = settings
        self._declare = declare_terminated  # runs in the child
        self.pid: Optional[int] = None
        self._write_fd: Optional[int] = None

    def start(self) -> None:
        read_fd, write_fd = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the monitor process
            code = 0
            try:
                os.close(write_fd)
                code = _Watcher(self.settings, parent, read_fd, self._declare).run()
            except BaseException:  # noqa: BLE001 - never fall back into the rank's code
                logger.exception("in-process monitor of rank %d failed", self.settings.rank)
                code = 1
            finally:
                os._exit(code)
        os.close(read_fd)
        os.set_blocking(write_fd, False)
        self.pid, self._write_fd = pid, write_fd

    def report_progress(self, last_progress: float) -> None:
        self._send(f"progress {last_progress:.6f}\n")

    def stop(self, timeout: float = 5.0) -> None:
        """Tell the monitor the rank leaves normally, and reap it."""
        if self.pid is None:
            return
        self._send("stop\n")
        os.close(self._write_fd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.01)
        else:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        self.pid = self._write_fd = None

    def _send(self, line: str) -> None:
        if self._write_fd is None:
            return
        try:
            os.write(self._write_fd, line.encode())
        except BlockingIOError:
            pass  # the monitor is behind; a newer line follows


class ProgressReporter(threading.Thread):
    """Pokes the main thread and forwards its progress to the monitor process; never uses the store.

    progress: a MainThreadProgress; in_function(): whether the wrapped function runs now.
    """

    def __init__(self, progress, monitor_process: MonitorProcess, in_function: Callable[[], bool], interval: float,
                 machinery_allowance: float, clock: Callable[[], float] = time.monotonic):
        super().__init__(name="nvrx-inprocess-progress", daemon=True)
        self.progress, self.monitor_process, self.in_function = progress, monitor_process, in_function
        self.interval, self.machinery_allowance, self._clock = interval, machinery_allowance, clock
        self._stop_event = threading.Event()

    def reported(self, now: float) -> float:
        """The progress time the monitor process is told (see the module docstring)."""
        last = self.progress.last
        if self.in_function():
            return last
        return max(last, min(now, last + self.machinery_allowance))

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.progress.poke()
            self.monitor_process.report_progress(self.reported(self._clock()))

    def shutdown(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


class _Watcher:
    """The monitor process's loop."""

    def __init__(self, settings: MonitorSettings, rank_pid: int, read_fd: int,
                 declare: Callable[[Cause, str], None]):
        self.settings = settings
        self.rank_pid = rank_pid
        self.read_fd = read_fd
        self.declare = declare
        self.last_progress = time.monotonic()
        self.buffer = b""
        self.events = ev.EventLog.from_env(source="inprocess_monitor")
        self.events.rank = settings.rank
        self.rank_process: Optional[ProcessHandle] = None

    def run(self) -> int:
        self._detach()
        if not self._hold_rank():
            return self._rank_gone("the rank process is gone")
        selector = selectors.DefaultSelector()
        selector.register(self.read_fd, selectors.EVENT_READ)
        while True:
            if selector.select(timeout=self.settings.interval):
                data = os.read(self.read_fd, 65536)
                if not data:
                    return self._rank_gone("the rank's end of the monitor pipe closed")
                if self._consume(data):
                    return 0
            if not self._still_parent():
                return self._rank_gone("the rank process is gone")
            stalled = time.monotonic() - self.last_progress
            if stalled > self.settings.hard_timeout:
                return self._kill(stalled)

    def _hold_rank(self) -> bool:
        """Open the rank's pidfd while it is certainly the rank (still this process's parent),
        so no signal of a kill can reach a process that reused its pid."""
        try:
            self.rank_process = ProcessHandle.open(self.rank_pid)
        except ProcessLookupError:
            return False
        return self._still_parent()

    def _still_parent(self) -> bool:
        """The rank is alive: a dead rank's child is handed to another parent."""
        return os.getppid() == self.rank_pid

    def _detach(self) -> None:
        """Forget the rank's signal handlers and logging; keep running if the rank's group is interrupted."""
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if self.settings.log_path:
            handler = logging.FileHandler(self.settings.log_path)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
        logger.info("monitor of rank %d (pid %d) started; hard_timeout=%.1f s", self.settings.rank,
                    self.rank_pid, self.settings.hard_timeout)

    def _consume(self, data: bytes) -> bool:
        """Apply complete lines; True on "stop"."""
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            word, _, value = line.decode(errors="replace").partition(" ")
            if word == "stop":
                logger.info("rank %d left the Wrapper; monitor exits", self.settings.rank)
                return True
            if word == "progress":
                try:
                    self.last_progress = max(self.last_progress, float(value))
                except ValueError:
                    logger.warning("malformed progress line %r", line[:80])
        return False

    def _kill(self, stalled: float) -> int:
        pid, settings = self.rank_pid, self.settings
        detail = f"no progress for {stalled:.1f} s > hard_timeout={settings.hard_timeout} s"
        logger.error("rank %d (pid %d): %s; killing it", settings.rank, pid, detail)
        # Declared first when the store answers at once: peers stop waiting for it, and if a
        # signal below wakes it up, it finds itself out of the job instead of rejoining for
        # the moment before it dies. A store that does not answer does not delay the kill.
        declaring = self._declare_in_background(Cause.HARD_TIMEOUT, detail)
        declaring.join(settings.declare_wait)
        if settings.stack_dump_signal is not None:  # faulthandler in the rank prints every thread's stack
            hang_kill.dump_stacks(self.rank_process, settings.stack_dump_signal, settings.stack_dump_grace)
        # Written before the signal: whoever sees the rank gone finds the record already there.
        self.events.emit(ev.RANK_KILLED, reason=Cause.HARD_TIMEOUT.value, pid=pid, detail=detail,
                         signal=signal.Signals(settings.termination_signal).name)
        if hang_kill.terminate_then_kill(self.rank_process, settings.termination_signal,
                                         settings.termination_grace, still_ours=self._still_parent):
            logger.error("rank %d (pid %d) survived the termination signal; sent SIGKILL", settings.rank, pid)
        self._finish_declaring(declaring)
        return 0

    def _rank_gone(self, detail: str) -> int:
        logger.error("rank %d: %s", self.settings.rank, detail)
        self._finish_declaring(self._declare_in_background(Cause.EXITED, detail))
        return 0

    def _declare_in_background(self, cause: Cause, detail: str) -> threading.Thread:
        self.events.emit(ev.INPROCESS_RANK_TERMINATED, cause=cause.value, detail=detail)
        thread = threading.Thread(target=self._declare_safely, args=(cause, detail), daemon=True)
        thread.start()
        return thread

    def _finish_declaring(self, thread: threading.Thread) -> None:
        thread.join(self.settings.declare_timeout)
        if thread.is_alive():
            logger.error("rank %d: the store did not take the declaration within %.0f s; peers will notice the "
                         "silence", self.settings.rank, self.settings.declare_timeout)

    def _declare_safely(self, cause: Cause, detail: str) -> None:
        try:
            self.declare(cause, detail)
        except Exception as e:  # the store may have died with the rank (rank 0 hosted it)
            logger.error("could not declare rank %d terminated in the store: %s", self.settings.rank, e)
