"""What the node monitor gathers when it first finds a rank of a cycle hung: who stopped first.

A hang spreads: the rank that stopped leaves its peers blocked in the next collective, and
their heartbeats stop too, so the first rank whose timeout expires is as often a waiting peer
as the culprit. At that first expiry in a cycle the monitor therefore asks every rank of the
cycle, before anything is killed:
- where it is in each process group's collective sequence (a `dump_collectives` message,
  answered by the rank's link thread: nvrx_core.ft.collective_trace);
- for its stacks (the faulthandler dump signal), reported as events once written; a rank that
  was asked where it is gets the signal only once it answered (or could not in time), since
  faulthandler walking the stack of a thread that runs Python can crash the rank (SIGSEGV in
  dump_traceback), and the link thread runs Python while it answers;
and records what the kernel says each process is doing (running, sleeping, stopped) and how
long each has been silent. The kill waits for the answers, at most ANSWER_WAIT seconds; a rank
that is stopped or holds the GIL cannot answer, and its silence is recorded as such.
nvrx_core.report reads these events and names the culprit.
"""

import time
from typing import Callable, Dict, Iterable, Optional, Set

from nvrx_core import events as ev
from nvrx_core.ft.watch import RankWatch
from nvrx_core.proc import process_state

ANSWER_WAIT = 2.0
"""Seconds the first kill of a cycle waits for the cycle's ranks to say where they are."""
MAX_STACK_EVENT_CHARS = 16384


def last_progress(w: RankWatch) -> float:
    """When the monitor last heard that `w` made progress (its connection, at the latest)."""
    return max(t for t in (w.connected_at, w.last_heartbeat, w.last_section_end) if t is not None)


class HangEvidence:
    """`ask(w)` sends a rank the dump_collectives request (False: it has no connection);
    `dump(w)` sends it the stack-dump signal; `read_stacks(w)` is its dump so far."""

    def __init__(self, events: ev.EventLog, clock: Callable[[], float], ask: Callable[[RankWatch], bool],
                 dump: Callable[[RankWatch], bool], read_stacks: Callable[[RankWatch], str],
                 schedule: Callable[[float, Callable[[], None]], object], stacks_after: float):
        self._events = events
        self._clock = clock
        self._ask = ask
        self._dump = dump
        self._read_stacks = read_stacks
        self._schedule = schedule
        self._stacks_after = stacks_after
        self._cycles: Set[int] = set()
        self._unanswered: Dict[int, RankWatch] = {}  # pid -> asked, no answer yet
        self._dump_after_answer: Dict[int, RankWatch] = {}  # pid -> its stacks wait for its answer
        self._asked_at = 0.0

    def hang_detected(self, hung: RankWatch, ranks: Iterable[RankWatch]) -> None:
        """Gather evidence from every rank of `hung`'s cycle, once per cycle."""
        if hung.cycle in self._cycles:
            return
        self._cycles.add(hung.cycle)
        now = self._asked_at = self._clock()
        wall = time.time()
        states = {}
        for w in ranks:
            if w.cycle != hung.cycle:
                continue
            state = process_state(w.pid)
            states[str(w.rank)] = {
                "process": state, "silent_s": round(now - last_progress(w), 3),
                "last_progress_time": round(wall - (now - last_progress(w)), 3),
                "open_sections": sorted(w.open_sections), "iteration": w.max_iteration,
            }
            asked = state not in (None, "stopped", "zombie") and self._ask(w)
            if asked:
                self._unanswered[w.pid] = w
            if w is hung:  # the hung rank's own dump is the kill's first step, after the answers
                continue
            if asked:
                self._dump_after_answer[w.pid] = w
            else:
                self._dump_stacks(w)
        self._events.emit(ev.HANG_EVIDENCE, rank=hung.rank, cycle=hung.cycle, ranks=states)

    def _dump_stacks(self, w: RankWatch) -> None:
        if self._dump(w):
            self._schedule(self._clock() + self._stacks_after, lambda: self.report_stacks(w, self._read_stacks(w)))

    def answered(self, w: RankWatch, msg: dict) -> None:
        self._unanswered.pop(w.pid, None)
        error = msg.get("error")
        self._events.emit(ev.COLLECTIVES_REPORTED, rank=w.rank, cycle=w.cycle, groups=msg["groups"],
                          error=error if isinstance(error, str) else None)
        if w.pid in self._dump_after_answer:
            self._dump_stacks(self._dump_after_answer.pop(w.pid))

    def awaiting_answers(self) -> bool:
        """Whether a kill should wait: a connected rank asked less than ANSWER_WAIT ago is silent.
        A rank that did not answer in that time gets its stack dump then."""
        if self._clock() - self._asked_at >= ANSWER_WAIT:
            self._unanswered.clear()
            late, self._dump_after_answer = self._dump_after_answer, {}
            for w in late.values():
                if w.connected:
                    self._dump_stacks(w)
        for pid, w in list(self._unanswered.items()):
            if not w.connected:
                del self._unanswered[pid]
                self._dump_after_answer.pop(pid, None)
        return bool(self._unanswered)

    def report_stacks(self, w: RankWatch, text: Optional[str]) -> None:
        if text and text.strip():
            self._events.emit(ev.STACKS_REPORTED, rank=w.rank, cycle=w.cycle, pid=w.pid,
                              stacks=text[:MAX_STACK_EVENT_CHARS])
