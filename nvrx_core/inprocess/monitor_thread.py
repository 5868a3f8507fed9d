"""The in-rank monitor thread: heartbeats, soft timeout, and faults elsewhere in the job.

Runs for the whole Wrapper call, on its own store client. Every monitor_interval it
- asks the main thread for a sign of progress (pending call) and forwards the last one
  to the hard-timeout monitor process;
- sends a heartbeat every heartbeat_interval;
while an iteration runs:
- ends the iteration when the store shows an interruption or a newly terminated rank;
- ends it on a soft timeout (the main thread ran no Python for soft_timeout);
- watches the heartbeats of the next two members (a ring, so every rank is watched
  without anyone reading all heartbeats) and declares a silent one lost.
Ending the iteration = abort communication (blocked collectives return) + interrupt the
main thread. It happens at most once per iteration.
"""

import logging
import threading
import time
from typing import Callable, List, Optional

from nvrx_core import events as ev
from nvrx_core.inprocess.abort import AbortProcessGroups
from nvrx_core.inprocess.config import InProcessConfig
from nvrx_core.inprocess.coordination import Coordinator, HeartbeatWatch
from nvrx_core.inprocess.interruption import MainThreadInterrupter, MainThreadProgress
from nvrx_core.inprocess.monitor_process import MonitorProcess
from nvrx_core.inprocess.records import ABORTED, INTERRUPTED, Cause

logger = logging.getLogger("nvrx.inprocess")
WATCHED_SUCCESSORS = 2


class MonitorThread(threading.Thread):
    def __init__(self, coordinator: Coordinator, config: InProcessConfig, interrupter: MainThreadInterrupter,
                 progress: MainThreadProgress, abort: AbortProcessGroups, monitor_process: Optional[MonitorProcess],
                 events: ev.EventLog, clock: Callable[[], float] = time.monotonic):
        super().__init__(name="nvrx-inprocess-monitor", daemon=True)
        self.coord = coordinator
        self.config = config
        self.interrupter = interrupter
        self.progress = progress
        self.abort = abort
        self.monitor_process = monitor_process
        self.events = events
        self._clock = clock
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._iteration: Optional[int] = None
        self._in_function = False
        self._terminated_base = 0
        self._successors: List[int] = []
        self.triggered: Optional[Cause] = None
        self.error: Optional[BaseException] = None
        self._next_heartbeat = self._next_watch = 0.0

    # ---- called by the main thread --------------------------------------------------
    def begin_iteration(self, iteration: int, members: List[int], terminated_base: int, in_function: bool) -> None:
        with self._lock:
            self._iteration, self._terminated_base, self.triggered = iteration, terminated_base, None
            self._in_function = in_function
            self._successors = _successors(members, self.coord.rank, WATCHED_SUCCESSORS)
        self.progress.touch()

    def leave_function(self) -> None:
        with self._lock:
            self._in_function = False

    def end_iteration(self) -> None:
        with self._lock:
            self._iteration, self._in_function = None, False

    def shutdown(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)

    # ---- the thread ------------------------------------------------------------------
    def run(self) -> None:
        watch = HeartbeatWatch(self._clock)
        while not self._stop_event.wait(self._period()):
            now = self._clock()
            self.progress.poke()
            self.abort.hold_current()
            if self.monitor_process is not None:  # local: must go on even when the store does not answer
                self.monitor_process.report_progress(self.progress.last)
            try:
                self._tick(now, watch)
            except Exception as e:  # a store hiccup; a store that is gone fails the main thread too
                if self.error is None or str(e) != str(self.error):
                    logger.error("in-process monitor thread: store request failed: %s", e)
                self.error = e

    def _tick(self, now: float, watch: HeartbeatWatch) -> None:
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval
            self.coord.heartbeat()
        iteration = self._iteration
        if iteration is None:
            return
        if self.triggered is not None:
            self._repeat_interruption()
            return
        self._check_iteration(iteration, now)
        if now >= self._next_watch and self.triggered is None:
            self._next_watch = now + self.config.heartbeat_interval
            self._watch_successors(iteration, watch)

    def _repeat_interruption(self) -> None:
        """Training code that swallowed the interruption (except BaseException) gets it again."""
        if self._in_function and self.interrupter.armed:
            self.interrupter.request(f"{self.triggered.value} (repeated)")

    def _period(self) -> float:
        return min(self.config.monitor_interval, self.config.heartbeat_interval)

    def _check_iteration(self, iteration: int, now: float) -> None:
        if self.coord.interrupted(iteration, self._terminated_base):
            self.trigger(iteration, Cause.PEER_INTERRUPTED, "another rank's fault")
            return
        idle = self.progress.idle_for(now)
        if self._in_function and idle > self.config.soft_timeout:
            detail = f"main thread ran no Python for {idle:.1f} s > soft_timeout={self.config.soft_timeout} s"
            self.coord.record(iteration, Cause.SOFT_TIMEOUT, detail)
            self.trigger(iteration, Cause.SOFT_TIMEOUT, detail)

    def _watch_successors(self, iteration: int, watch: HeartbeatWatch) -> None:
        watch.update(self.coord.heartbeats(self._successors))
        for rank in watch.stale(self.config.heartbeat_timeout):
            if rank not in self._successors:
                continue
            detail = f"no heartbeat for {self.config.heartbeat_timeout} s (seen by rank {self.coord.rank})"
            if self.coord.mark_terminated(rank, Cause.HEARTBEAT_LOST, detail):
                self.coord.record(iteration, Cause.HEARTBEAT_LOST, detail, rank=rank)
            self.trigger(iteration, Cause.PEER_INTERRUPTED, f"rank {rank} lost")
            return

    def trigger(self, iteration: int, cause: Cause, detail: str) -> None:
        """End the iteration on this rank: abort communication, then interrupt the main thread."""
        with self._lock:
            if self._iteration != iteration or self.triggered is not None:
                return
            self.triggered = cause
            in_function = self._in_function
        self.events.emit(INTERRUPTED, iteration=iteration, cause=cause.value, detail=detail, by="monitor")
        shut = self.abort.abort_communication()
        self.events.emit(ABORTED, iteration=iteration, connections_shut_down=shut, by="monitor")
        if in_function:
            self.interrupter.request(f"{cause.value}: {detail}")


def _successors(members: List[int], rank: int, count: int) -> List[int]:
    ring = sorted(members)
    if rank not in ring or len(ring) < 2:
        return []
    start = ring.index(rank)
    return [ring[(start + i) % len(ring)] for i in range(1, min(count, len(ring) - 1) + 1)]
