"""The in-rank monitor thread: heartbeats, soft timeout, and faults elsewhere in the job.

Runs for the whole Wrapper call, on its own store client (a BoundedStore: every request
ends within store_request_timeout). Every monitor_interval it
- evaluates the soft timeout (the main thread ran no Python for soft_timeout while in the
  wrapped function) from local state only, before any store request, so that a store
  that stops answering cannot keep it from firing;
- sends a heartbeat every heartbeat_interval;
while an iteration runs:
- ends the iteration when the store shows an interruption or a newly terminated rank;
- watches the heartbeats of the next two members (a ring, so every rank is watched
  without anyone reading all heartbeats) and declares a silent one lost; silence counts
  only while this thread could read the store (HeartbeatWatch.blind_after).
Ending the iteration = abort communication (blocked collectives return) + interrupt the
main thread. It happens at most once per iteration. If the main thread is still stuck
afterwards inside process-group creation, where neither can reach it (gloo waiting for a
peer's connection), the listening sockets of the iteration are given the connections
they wait for (torch_compat.release_gloo_connection_waits), so the constructor raises.

The hard timeout does not depend on this thread: ProgressReporter (monitor_process.py)
feeds the monitor process, so a store stall here cannot get a healthy rank killed.
"""

import logging
import sys
import threading
import time
from typing import Callable, List, Optional

from nvrx_core import events as ev
from nvrx_core import torch_compat
from nvrx_core.inprocess.abort import AbortProcessGroups
from nvrx_core.inprocess.config import InProcessConfig
from nvrx_core.inprocess.coordination import Coordinator, HeartbeatWatch, blind_gap
from nvrx_core.inprocess.interruption import MainThreadInterrupter, MainThreadProgress
from nvrx_core.inprocess.records import Cause
from nvrx_core.inprocess.store import StoreUnavailable

logger = logging.getLogger("nvrx.inprocess")
WATCHED_SUCCESSORS = 2
GROUP_CREATION = "_new_process_group_helper"  # torch.distributed's function that has a backend constructed


class MonitorThread(threading.Thread):
    def __init__(self, coordinator: Coordinator, config: InProcessConfig, interrupter: MainThreadInterrupter,
                 progress: MainThreadProgress, abort: AbortProcessGroups, events: ev.EventLog,
                 main_frame: Optional[Callable[[], object]] = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(name="nvrx-inprocess-monitor", daemon=True)
        self.coord = coordinator
        self.config = config
        self.interrupter = interrupter
        self.progress = progress
        self.abort = abort
        self.events = events
        self._main_frame = main_frame or _main_thread_frame
        self._clock = clock
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._iteration: Optional[int] = None
        self._in_function = False
        self._terminated_base = 0
        self._members: List[int] = []
        self._successors: List[int] = []
        self.triggered: Optional[Cause] = None
        self.soft_timeout_detected: Optional[str] = None  # its detail, set before the store record
        self.soft_timeout_recorded = False
        self._triggered_at = 0.0
        self._released = False
        self.error: Optional[BaseException] = None
        self._next_heartbeat = self._next_watch = 0.0

    # ---- called by the main thread --------------------------------------------------
    def begin_iteration(self, iteration: int, members: List[int], terminated_base: int) -> None:
        with self._lock:
            self._iteration, self._terminated_base, self.triggered = iteration, terminated_base, None
            self._in_function, self.soft_timeout_recorded, self._released = False, False, False
            self.soft_timeout_detected = None
            self._members = list(members)
            self._successors = _successors(members, self.coord.rank, WATCHED_SUCCESSORS)
        self.progress.touch()

    @property
    def in_function(self) -> bool:
        return self._in_function

    def enter_function(self) -> None:
        self.progress.touch()
        with self._lock:
            self._in_function = True

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
        watch = HeartbeatWatch(self._clock, blind_after=blind_gap(self.config.heartbeat_interval))
        while not self._stop_event.wait(self._period()):
            now = self._clock()
            self.abort.hold_current()
            try:
                self._check_soft_timeout(now)  # first, and needs the store only for its record
                self._release_stuck_creation(now)
                self._tick(now, watch)
            except StoreUnavailable as e:  # the BoundedStore logs when a stall begins and ends
                logger.debug("in-process monitor thread: %s", e)
            except Exception as e:  # a store hiccup; a store that is gone fails the main thread too
                if self.error is None or str(e) != str(self.error):
                    logger.error("in-process monitor thread: %s", e)
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
        if self.coord.interrupted(iteration, self._terminated_base):
            self.trigger(iteration, Cause.PEER_INTERRUPTED, "another rank's fault")
            return
        if now >= self._next_watch:
            self._next_watch = now + self.config.heartbeat_interval
            self._watch_successors(iteration, watch)

    def _repeat_interruption(self) -> None:
        """Training code that swallowed the interruption (except BaseException) gets it again."""
        if self._in_function and self.interrupter.armed:
            self.interrupter.request(f"{self.triggered.value} (repeated)")

    def _period(self) -> float:
        return min(self.config.monitor_interval, self.config.heartbeat_interval)

    def _check_soft_timeout(self, now: float) -> None:
        iteration = self._iteration
        if iteration is None or self.triggered is not None or not self._in_function:
            return
        idle = self.progress.idle_for(now)
        if idle <= self.config.soft_timeout:
            return
        detail = f"main thread ran no Python for {idle:.1f} s > soft_timeout={self.config.soft_timeout} s"
        try:
            if self.coord.interrupted(iteration, self._terminated_base):  # stuck because a peer failed
                self.trigger(iteration, Cause.PEER_INTERRUPTED, "another rank's fault")
                return
            # Marked before the record: the record can end the iteration everywhere (a peer aborts,
            # this rank's collective fails) before trigger() below runs, and the main thread must
            # then still classify this rank's exit as its soft timeout, not as a peer's fault.
            with self._lock:
                if self._iteration != iteration or self.triggered is not None:
                    return
                self.soft_timeout_detected = detail
            self.coord.record(iteration, Cause.SOFT_TIMEOUT, detail)
            self.soft_timeout_recorded = True
        except Exception as e:  # the main thread records it once the store answers
            logger.warning("soft timeout of iteration %d not recorded yet (%s); interrupting anyway", iteration, e)
        self.trigger(iteration, Cause.SOFT_TIMEOUT, detail)

    def _release_stuck_creation(self, now: float) -> None:
        """After an abort, free a main thread stuck in process-group creation (see the module docstring)."""
        if self.triggered is None or self._released or not self._in_function:
            return
        delay = max(2 * self.config.monitor_interval, 0.2)
        if now - self._triggered_at < delay or self.progress.idle_for(now) < delay:
            return
        if not _creating_group(self._main_frame()):
            return
        self._released = True
        listeners = self.abort.connections.listeners()
        made = torch_compat.release_gloo_connection_waits(listeners, max(len(self._members), 1))
        logger.warning("rank %d is stuck creating a process group after the abort: gave its %d listening "
                       "socket(s) %d connection(s) to end gloo's connect wait", self.coord.rank, len(listeners), made)

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
            self._triggered_at = self._clock()
            in_function = self._in_function
        self.events.emit(ev.INPROCESS_INTERRUPTED, iteration=iteration, cause=cause.value, detail=detail, by="monitor")
        shut = self.abort.abort_communication()
        self.events.emit(ev.INPROCESS_ABORTED, iteration=iteration, connections_shut_down=shut, by="monitor")
        if in_function:
            self.interrupter.request(f"{cause.value}: {detail}")


def _creating_group(frame) -> bool:
    """Whether `frame` (the main thread's innermost) is torch creating a process group.

    torch 2.13 calls the backend's constructor from _new_process_group_helper itself,
    torch 2.14 from a helper it calls (_create_gloo_process_group): look a few frames up,
    through torch's own code only.
    """
    for _ in range(6):
        if frame is None or "torch" not in frame.f_code.co_filename:
            return False
        if frame.f_code.co_name == GROUP_CREATION:
            return True
        frame = frame.f_back
    return False


def _main_thread_frame():
    """The frame the main thread executes now (None if it has none)."""
    return sys._current_frames().get(threading.main_thread().ident)


def _successors(members: List[int], rank: int, count: int) -> List[int]:
    ring = sorted(members)
    if rank not in ring or len(ring) < 2:
        return []
    start = ring.index(rank)
    return [ring[(start + i) % len(ring)] for i in range(1, min(count, len(ring) - 1) + 1)]
