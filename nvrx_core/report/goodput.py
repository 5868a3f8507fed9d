"""Effective training time ratio (ETTR, goodput): the share of the wall time that trained.

Wall time runs from the first launcher process's start to the last one's exit: one file may
hold every attempt of a requeued job. Each step execution is timed from rank 0's step_done
records (the first step of a cycle from the cycle's training_resumed). An execution counts as
productive unless a cycle that began later (of this attempt or a later one) resumed from an
earlier step and ran it again; the rest of the wall time is assigned to where it went:
- startup: each attempt's launcher start to its first training start;
- requeue: between attempts, while no launcher of the job ran (the scheduler's requeue);
- redone: executions run again later, and the part-step in progress when a fault began;
- detection: fault to detection; restart: detection to the next cycle's training start;
- checkpoint: the excess over the median step of steps that include a checkpoint commit;
- shutdown: the last step to the launcher's exit; other: whatever is left (a run that
  ended without a last step, time no record covers).
"""

import dataclasses
import statistics
from typing import Dict, List, Optional, Tuple

from nvrx_core import events as ev
from nvrx_core.report.incidents import CycleKey, Incident, by_cycle, launcher_of

CATEGORIES = ("productive", "startup", "detection", "restart", "redone", "checkpoint", "requeue", "shutdown",
              "other")


@dataclasses.dataclass
class Goodput:
    wall_s: float
    seconds: Dict[str, float]
    """Seconds per category (CATEGORIES); they add up to wall_s."""
    steps_kept: int
    steps_redone: int
    step_median_s: Optional[float]
    executions: List[Tuple[CycleKey, int, float, float, bool]] = dataclasses.field(default_factory=list)
    """(cycle key, step, start, end, kept) of every step execution: the timeline's bars."""

    @property
    def ettr(self) -> Optional[float]:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 and self.steps_kept else None


def _rank0(e: dict) -> bool:
    return e.get("rank") in (0, None)


def run_span(events: List[dict]) -> Tuple[float, float]:
    starts = [e.get("process_started") for e in events if e["kind"] == ev.LAUNCHER_STARTED]
    starts = [t for t in starts if isinstance(t, (int, float))]
    start = min(starts) if starts else events[0]["time"]
    exits = [e["time"] for e in events if e["kind"] == ev.LAUNCHER_EXIT]
    return start, (max(exits) if exits else events[-1]["time"])


def attempts(events: List[dict]) -> List[Tuple[float, float]]:
    """(start, end) of each attempt of the job: the launchers' process spans, overlapping ones
    (the nodes of one attempt) merged, in time order."""
    spans: Dict[Optional[str], List[float]] = {}
    for e in events:
        span = spans.setdefault(launcher_of(e), [e["time"], e["time"]])
        started = e.get("process_started") if e["kind"] == ev.LAUNCHER_STARTED else None
        span[0] = min(span[0], started if isinstance(started, (int, float)) else e["time"])
        span[1] = max(span[1], e["time"])
    merged: List[List[float]] = []
    for start, end in sorted(spans.values()):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def step_executions(events: List[dict]) -> List[Tuple[CycleKey, int, float, float]]:
    """(cycle key, step, start, end) of every step rank 0 completed."""
    out = []
    for key, own in sorted(by_cycle(events).items(), key=lambda item: item[1][0]["time"]):
        previous = None
        for e in own:
            if not _rank0(e):
                continue
            if e["kind"] == ev.TRAINING_RESUMED:
                previous = e["time"]
            elif e["kind"] == ev.STEP_DONE and isinstance(e.get("step"), int):
                if previous is not None:
                    out.append((key, e["step"], previous, e["time"]))
                previous = e["time"]
    return out


def _resumed_at(events: List[dict]) -> Dict[CycleKey, Tuple[float, int]]:
    """cycle key -> (time, step) of rank 0's training_resumed (the step it resumed from)."""
    out = {}
    for key, own in by_cycle(events).items():
        for e in own:
            if e["kind"] == ev.TRAINING_RESUMED and _rank0(e):
                out.setdefault(key, (e["time"], e.get("step") if isinstance(e.get("step"), int) else 0))
        if key not in out:  # a loop that records no resumption: its first step done stands in
            first = next((e for e in own if e["kind"] == ev.STEP_DONE and _rank0(e) and isinstance(e.get("step"), int)),
                         None)
            if first is not None:
                out[key] = (first["time"], first["step"] - 1)
    return out


def _redone_later(step: int, end: float, resumed: Dict[CycleKey, Tuple[float, int]]) -> bool:
    """A cycle that resumed after this execution ended resumed from before `step`: a later
    cycle of the same launcher, or of a later attempt of the job (a Slurm requeue)."""
    return any(t > end and s < step for t, s in resumed.values())


def goodput(events: List[dict], incidents: List[Incident]) -> Optional[Goodput]:
    if not events:
        return None
    start, end = run_span(events)
    wall = max(0.0, end - start)
    resumed = _resumed_at(events)
    executions = step_executions(events)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    marked = []
    for key, step, t0, t1 in executions:
        marked.append((key, step, t0, t1, not _redone_later(step, t1, resumed)))
    durations = [t1 - t0 for *_, t0, t1, kept in marked if kept]
    median = statistics.median(durations) if durations else None
    commits = [e["time"] for e in events if e["kind"] == ev.CHECKPOINT_COMMITTED and _rank0(e)]
    for _, step, t0, t1, kept in marked:
        if not kept:
            seconds["redone"] += t1 - t0
            continue
        stall = 0.0
        if median is not None and any(t0 < t <= t1 for t in commits):
            stall = max(0.0, (t1 - t0) - median)
        seconds["checkpoint"] += stall
        seconds["productive"] += (t1 - t0) - stall
    spans = attempts(events)
    for (_, end_before), (begin, _) in zip(spans, spans[1:]):
        seconds["requeue"] += max(0.0, begin - end_before)
    for begin, end_of in spans:
        trained = [t for t, _ in resumed.values() if begin <= t <= end_of]
        if trained:
            seconds["startup"] += min(trained) - begin
    for incident in incidents:
        _add_incident(seconds, incident, marked, resumed)
    if marked and any(e["kind"] == ev.TRAINING_FINISHED for e in events):
        seconds["shutdown"] = max(0.0, end - max(t1 for *_, t1, _ in marked))
    seconds["other"] = max(0.0, wall - sum(v for k, v in seconds.items() if k != "other"))
    return Goodput(wall, seconds, steps_kept=sum(1 for m in marked if m[4]),
                   steps_redone=sum(1 for m in marked if not m[4]), step_median_s=median, executions=marked)


def _add_incident(seconds: Dict[str, float], incident: Incident, marked: list, resumed: dict) -> None:
    fault, detected = incident.fault_time, incident.detected_time
    if fault is None or detected is None:
        return
    # A peer may finish a step a moment after the culprit's last sign of progress: count the
    # time from whichever came later, so no second is counted twice.
    ends = [t1 for key, _, _, t1, _ in marked if key == incident.key and t1 <= detected]
    anchor = max([fault, *ends])
    done_before = [t1 for t1 in ends if t1 <= fault]
    if done_before and anchor == fault:
        seconds["redone"] += max(0.0, fault - max(done_before))  # the part-step in progress
    seconds["detection"] += max(0.0, detected - anchor)
    source, launcher, cycle = incident.key
    restart = resumed.get((source, launcher, cycle + 1))
    if restart is not None:
        seconds["restart"] += max(0.0, restart[0] - detected)
