"""A run cut into incidents: one per failed restart cycle, with its verdict and its timings.

An incident's clock: the fault began (as the evidence tells: the culprit's exception, its
connection dropping, its last progress before a hang), was detected (the monitor's timeout,
the agent seeing a worker exit), every worker was stopped (the next cycle began), the
workers were started again, and the first step after that completed. Steps redone are the
steps completed in the failed cycle beyond the one the next cycle resumed from.

A fault injection record (nvrx_core.ft.faults) is ground truth for rehearsals; it is shown
beside the verdict and never used to reach it.
"""

import dataclasses
from typing import Dict, List, Optional, Tuple

from nvrx_core import events as ev
from nvrx_core.exit_codes import ExitCode
from nvrx_core.report.attribution import Verdict, attribute
from nvrx_core.report.events_file import SOURCE

FAILURE_KINDS = frozenset({ev.WORKERS_FAILED, ev.FAULT_DETECTED, "hang_evidence", ev.NODE_LOST})
PROGRESS_KINDS = (ev.STEP_DONE, ev.FIRST_PROGRESS)


@dataclasses.dataclass
class Incident:
    cycle: int
    verdict: Verdict
    fault_time: Optional[float]
    detected_time: Optional[float]
    stopped_time: Optional[float]
    """The next cycle began (or the launcher exited): every worker of this one was stopped."""
    restarted_time: Optional[float]
    """The next cycle's workers were started."""
    first_step_time: Optional[float]
    """The next cycle's first step done (its first heartbeat, for jobs that log no steps)."""
    last_step: Optional[int]
    resumed_from: Optional[int]
    injected: Optional[dict] = None
    key: Optional[tuple] = None
    """(events file, launcher, cycle): which launcher process's cycle this was."""

    @property
    def steps_redone(self) -> Optional[int]:
        if self.last_step is None or self.resumed_from is None:
            return None
        return max(0, self.last_step - self.resumed_from)

    @staticmethod
    def _span(start: Optional[float], end: Optional[float]) -> Optional[float]:
        return None if start is None or end is None else max(0.0, end - start)

    @property
    def detect_s(self) -> Optional[float]:
        return self._span(self.fault_time, self.detected_time)

    @property
    def stop_s(self) -> Optional[float]:
        return self._span(self.detected_time, self.stopped_time)

    @property
    def restart_s(self) -> Optional[float]:
        return self._span(self.stopped_time, self.restarted_time)

    @property
    def first_step_s(self) -> Optional[float]:
        return self._span(self.restarted_time, self.first_step_time)

    @property
    def resumed_after(self) -> Optional[float]:
        """Seconds from the fault to the first step of the restarted job."""
        return self._span(self.fault_time, self.first_step_time)


CycleKey = Tuple[Optional[int], Optional[str], int]


def launcher_of(e: dict) -> Optional[str]:
    """Which launcher process wrote `e` (or, for files written before records named it, its node):
    every attempt of a requeued job counts its cycles from 0 again."""
    return e.get("launcher") or e.get("node")


def by_cycle(events: List[dict]) -> Dict[CycleKey, List[dict]]:
    """Events per restart cycle of one launcher process: keyed by (events file, launcher, cycle)."""
    out: Dict[CycleKey, List[dict]] = {}
    for e in events:
        if isinstance(e.get("cycle"), int):
            out.setdefault((e.get(SOURCE), launcher_of(e), e["cycle"]), []).append(e)
    return out


def _first(events: List[dict], *kinds: str) -> Optional[dict]:
    return next((e for e in events if e["kind"] in kinds), None)


def _failed(window: List[dict], is_last: bool, exit_event: Optional[dict]) -> bool:
    """A cycle failed if it holds a failure record, or it was the last and the launcher then
    exited with an error. Not a preemption the launcher was told of (its stop signal, after
    which every rank saved): the scheduler took the job; nothing in it failed."""
    if any(e["kind"] in FAILURE_KINDS for e in window):
        return True
    return is_last and exit_event is not None and exit_event.get("exit_code") not in (0, None, ExitCode.PREEMPTED)


def find_incidents(events: List[dict]) -> List[Incident]:
    """Every failed cycle of a run (`events` in time order), in the order they began.

    Events of no cycle (the rendezvous's: a node lost, a spare activated) belong to every
    launcher's cycle that was running when they happened: the node that noticed a loss may
    be another than the one whose workers it stopped."""
    cycles = by_cycle(events)
    uncycled = [e for e in events if not isinstance(e.get("cycle"), int)]
    incidents = []
    for key in sorted(cycles, key=lambda k: cycles[k][0]["time"]):
        source, launcher, cycle = key
        own, after = cycles[key], cycles.get((source, launcher, cycle + 1), [])
        exit_event = next((e for e in reversed(events) if e["kind"] == ev.LAUNCHER_EXIT
                           and e.get(SOURCE) == source and launcher_of(e) == launcher), None)
        start, end = own[0]["time"], (after[0]["time"] if after else float("inf"))
        window = sorted(own + [e for e in uncycled if start <= e["time"] < end], key=lambda e: e["time"])
        if _failed(window, not after, exit_event):
            incidents.append(_timed(key, attribute(window), window, after, exit_event))
    return incidents


def _timed(key: CycleKey, verdict: Verdict, own: List[dict], after: List[dict], exit_event: Optional[dict]) -> Incident:
    detected = _first(own, ev.FAULT_DETECTED, "hang_evidence", ev.WORKERS_FAILED, ev.NODE_LOST,
                      ev.STRAGGLER_FOUND, "preemption_agreed", ev.LAUNCHER_SIGNALED)
    detected_time = detected["time"] if detected is not None else None
    fault_time = verdict.fault_time
    if fault_time is None or (detected_time is not None and fault_time > detected_time):
        fault_time = detected_time
    stopped = _first(after, ev.RESTART_BEGUN) or (exit_event if not after else None)
    started = _first(after, ev.WORKERS_STARTED)
    first_step = _first(after, ev.STEP_DONE) or _first(after, ev.FIRST_PROGRESS)
    steps = [e["step"] for e in own if e["kind"] == ev.STEP_DONE and isinstance(e.get("step"), int)]
    resumed = [e["step"] for e in after if e["kind"] == ev.TRAINING_RESUMED and isinstance(e.get("step"), int)]
    return Incident(
        cycle=key[2], key=key, verdict=verdict, fault_time=fault_time, detected_time=detected_time,
        stopped_time=stopped["time"] if stopped is not None else None,
        restarted_time=started["time"] if started is not None else None,
        first_step_time=first_step["time"] if first_step is not None else None,
        last_step=max(steps) if steps else None, resumed_from=min(resumed) if resumed else None,
        injected=_first(own, ev.FAULT_INJECTED),
    )
