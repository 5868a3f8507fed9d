"""How the node monitor takes down a hung rank, and the clock of scheduled steps it runs on.

The sequence is nvrx_core.hang_kill's, shared with the in-process monitor: once the cycle's
ranks answered where they stand (ft.hang_evidence, bounded), ask the rank for a stack dump
(faulthandler on stack_dump_signal), wait until the dump is written (hang_kill.DumpWatch),
report it, terminate it (rank_termination_signal, then SIGCONT) and escalate to SIGKILL if
the rank is still alive termination_grace later. What is the node monitor's own: the hung
ranks of a cycle are terminated together, once all their dumps are written: a hang spreads,
so a waiting peer's timeout expires a moment after the culprit's, and when the peer died
first torch's agent stopped every worker, the culprit with its dump unwritten. Each step is
a scheduled action, so timing never blocks the monitor's serving of the other ranks.

Every signal goes through the rank's pidfd (RankWatch.proc), opened when the rank
connected, so no step can reach another process that reused the pid. Steps still pending
are cancelled when the rank's process has exited. A rank that merely disconnected (closed its
socket, maybe in its SIGTERM handler) but is still running is still hung: its kill goes on,
through the pidfd. Only where the kernel has no pidfds is a disconnect taken as "gone": a bare
pid must not be signalled once nothing proves it is still the rank's.
"""

import dataclasses
import heapq
import logging
import signal
from typing import Callable, Dict, List, Optional

from nvrx_core import events as ev
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.watch import RankWatch
from nvrx_core.hang_kill import DUMP_POLL, DumpWatch, escalate, terminate
from nvrx_core.proc import process_state

logger = logging.getLogger("nvrx.ft.monitor")


class Scheduler:
    """Timed actions, earliest first; a cancelled action is skipped when it comes due."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._heap: List[list] = []
        self._seq = 0

    def at(self, when: float, action: Callable[[], None]) -> list:
        self._seq += 1
        entry = [when, self._seq, action]
        heapq.heappush(self._heap, entry)
        return entry

    @staticmethod
    def cancel(entry: list) -> None:
        entry[2] = None

    def next_time(self) -> Optional[float]:
        while self._heap and self._heap[0][2] is None:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def run_due(self) -> None:
        while self._heap and self._heap[0][0] <= self._clock():
            _, _, action = heapq.heappop(self._heap)
            if action is not None:
                action()


SendSignal = Callable[[RankWatch, int], bool]
EXIT_POLL = 0.05
"""Seconds between looks at a disconnected rank's pidfd while its kill has steps pending."""


@dataclasses.dataclass
class _Dump:
    """A hung rank's kill, waiting for the dumps of its cycle."""
    w: RankWatch
    written: bool = False


def signal_by_handle(w: RankWatch, sig: int) -> bool:
    """Send `sig` to the rank's process through its pidfd; False once it has exited."""
    return w.proc is not None and w.proc.send_signal(sig)


class Killer:
    """Runs the kill sequence of hung ranks (see the module docstring)."""

    def __init__(self, cfg: FTConfig, events: ev.EventLog, scheduler: Scheduler, clock: Callable[[], float],
                 send_signal: SendSignal, report_stacks: Callable[[RankWatch], None],
                 awaiting_evidence: Callable[[], bool] = lambda: False,
                 dump_size: Callable[[RankWatch], Optional[int]] = lambda w: None):
        """`awaiting_evidence`: whether ranks asked where they stand (ft.hang_evidence) have yet
        to answer; the dump signal waits for them (bounded there). `dump_size`: the
        size of the rank's dump file (None: it has none, its dumps go to stderr)."""
        self.cfg = cfg
        self.events = events
        self._sched = scheduler
        self._clock = clock
        self._send = send_signal
        self._report_stacks = report_stacks
        self._awaiting_evidence = awaiting_evidence
        self._dump_size = dump_size
        self._dumping: Dict[int, Dict[int, _Dump]] = {}  # cycle -> pid -> a kill waiting for dumps

    def begin(self, w: RankWatch, reason: str, overdue: float) -> None:
        w.expired = True
        logger.error("rank %d (pid %d) hung: %s; dumping its stacks, then terminating it", w.rank, w.pid, reason)
        self.events.emit(
            ev.FAULT_DETECTED, rank=w.rank, cycle=w.cycle, fault="hang", reason=reason,
            pid=w.pid, open_sections=sorted(w.open_sections), overdue_s=round(overdue, 3),
        )
        self._dumping.setdefault(w.cycle, {})[w.pid] = _Dump(w)
        self._dump_once_answered(w)

    def _dump_once_answered(self, w: RankWatch) -> None:
        """Send the dump signal once the cycle's ranks answered where they stand (ft.hang_evidence
        bounds that wait): faulthandler walking a thread that runs Python, as the link thread
        does while it answers, can crash the rank (SIGSEGV in dump_traceback)."""
        if self._awaiting_evidence():
            self._then(w, self._clock() + DUMP_POLL, lambda: self._dump_once_answered(w))
            return
        before = self._dump_size(w)
        if not self._send(w, self.cfg.stack_dump_signal):
            self._finish(w)  # nothing to wait for: the process is gone or cannot be signalled
            return
        self.events.emit(ev.STACKS_DUMPED, rank=w.rank, cycle=w.cycle, pid=w.pid,
                         signal=self.cfg.stack_dump_signal.name)
        dump = DumpWatch(sent=self._clock(), before=before)
        self._then(w, dump.sent + self.cfg.stack_dump_grace, lambda: self._terminate_after_dump(w, dump))

    def rank_disconnected(self, w: RankWatch) -> None:
        """The rank's connection closed: cancel what is left of its kill once its process is gone.

        The socket closes a moment before the process counts as exited (its files are closed
        first), so a process still running is looked at again every EXIT_POLL seconds while
        kill steps are pending."""
        w.connected = False
        if not w.pending:
            self._release_if_done(w)
        elif w.proc is None or not w.proc.by_pidfd or w.proc.exited():
            for entry in w.pending:
                Scheduler.cancel(entry)
            w.pending.clear()
            self._forget_dump(w)  # its process is gone
            self._release_if_done(w)
        else:
            self._sched.at(self._clock() + EXIT_POLL, lambda: self.rank_disconnected(w))

    def _then(self, w: RankWatch, when: float, step: Callable[[], None]) -> None:
        def run():
            w.pending[:] = [e for e in w.pending if e is not entry]
            step()
            self._release_if_done(w)
        entry = self._sched.at(when, run)
        w.pending.append(entry)

    @staticmethod
    def _release_if_done(w: RankWatch) -> None:
        """Close the pidfd once neither the connection nor a kill step needs it."""
        if not w.connected and not w.pending and w.proc is not None:
            w.proc.close()

    def _dump_pending(self, w: RankWatch) -> bool:
        return w.proc is not None and w.proc.signal_pending(self.cfg.stack_dump_signal)

    def _terminate_after_dump(self, w: RankWatch, dump: DumpWatch) -> None:
        """Terminate the cycle's hung ranks once all their dumps are written (module docstring),
        or this one alone once its dump is overdue (hang_kill.DUMP_WAIT_LIMIT)."""
        written = dump.look(self._dump_pending(w), process_state(w.pid), self._dump_size(w))
        cycle = self._dumping.get(w.cycle, {})
        if w.pid in cycle:
            cycle[w.pid].written = written
        if all(d.written for d in cycle.values()):
            for d in list(cycle.values()):
                self._finish(d.w)
        elif dump.overdue(self._clock()):
            self._finish(w)
        else:
            self._then(w, self._clock() + DUMP_POLL, lambda: self._terminate_after_dump(w, dump))

    def _forget_dump(self, w: RankWatch) -> None:
        cycle = self._dumping.get(w.cycle, {})
        cycle.pop(w.pid, None)
        if not cycle:
            self._dumping.pop(w.cycle, None)

    def _finish(self, w: RankWatch) -> None:
        """Report the rank's dump and terminate it; its next look at the dump is cancelled."""
        self._forget_dump(w)
        for entry in w.pending:
            Scheduler.cancel(entry)
        w.pending.clear()
        self._report_stacks(w)
        self._terminate(w)
        self._release_if_done(w)

    def _terminate(self, w: RankWatch) -> None:
        sig = self.cfg.rank_termination_signal
        if not terminate(lambda s: self._send(w, s), sig):
            return
        self.events.emit(ev.RANK_KILLED, rank=w.rank, cycle=w.cycle, pid=w.pid, signal=sig.name)
        if sig != signal.SIGKILL:
            self._then(w, self._clock() + self.cfg.termination_grace, lambda: self._escalate(w))

    def _escalate(self, w: RankWatch) -> None:
        if escalate(lambda s: self._send(w, s)):
            logger.error("rank %d (pid %d) survived %s; sent SIGKILL", w.rank, w.pid,
                         self.cfg.rank_termination_signal.name)
