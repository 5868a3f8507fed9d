"""Incident summaries from the event log: what failed, when it was noticed, when training resumed.

Reads the timeline every part writes (nvrx_core.events) and reduces each failed restart
cycle to one Incident. Used by `nvrx demo` and the recovery benchmark; also handy after a
real incident (`nvrx incidents events.jsonl`).
"""

import dataclasses
from typing import Dict, List, Optional

from nvrx_core import events as ev


@dataclasses.dataclass
class Incident:
    cycle: int
    fault: str
    """What happened: an injected fault kind, 'hang' (monitor) or 'crash' (a worker exited)."""
    rank: Optional[int]
    detected_after: float
    """Seconds from the fault (its injection, when known) to its detection."""
    resumed_after: Optional[float]
    """Seconds from the fault to the first step completed by the restarted job (its first
    heartbeat or section end, seen by the monitor, for jobs that log no steps)."""
    last_step: Optional[int]
    resumed_from: Optional[int]

    @property
    def steps_redone(self) -> Optional[int]:
        if self.last_step is None or self.resumed_from is None:
            return None
        return self.last_step - self.resumed_from

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "a rank"
        resumed = f"{self.resumed_after:.2f} s" if self.resumed_after is not None else "never"
        redone = self.steps_redone if self.steps_redone is not None else "?"
        return (f"cycle {self.cycle}: {self.fault} in {who}: detected after {self.detected_after:.2f} s, "
                f"training resumed after {resumed} (from step {self.resumed_from}), steps redone: {redone}")


def _by_cycle(events: List[dict], kind: str) -> Dict[int, List[dict]]:
    out: Dict[int, List[dict]] = {}
    for e in events:
        if e["kind"] == kind and e.get("cycle") is not None:
            out.setdefault(e["cycle"], []).append(e)
    return out


def summarize(events: List[dict]) -> List[Incident]:
    failed = _by_cycle(events, ev.WORKERS_FAILED)
    injected = _by_cycle(events, ev.FAULT_INJECTED)
    detected = _by_cycle(events, ev.FAULT_DETECTED)
    steps = _by_cycle(events, ev.STEP_DONE)
    progress = _by_cycle(events, ev.FIRST_PROGRESS)  # for jobs that log no steps of their own
    resumed = _by_cycle(events, ev.TRAINING_RESUMED)
    incidents = []
    for cycle in sorted(failed):
        failure = failed[cycle][0]
        inj = injected.get(cycle, [None])[0]
        det = detected.get(cycle, [None])[0]
        if inj is not None:
            fault, rank, start = inj.get("fault", "fault"), inj.get("rank"), inj["time"]
        elif det is not None:
            fault, rank, start = "hang", det.get("rank"), det["time"]
        else:
            codes = failure.get("exit_codes", {})
            fault, rank, start = "crash", (int(min(codes)) if codes else None), failure["time"]
        noticed = det["time"] if det is not None else failure["time"]
        later_steps = [e for c, es in steps.items() if c > cycle for e in es]
        later_steps = later_steps or [e for c, es in progress.items() if c > cycle for e in es]
        first_after = min(later_steps, key=lambda e: e["time"]) if later_steps else None
        restart_from = [e.get("step") for e in resumed.get(cycle + 1, []) if e.get("step") is not None]
        incidents.append(Incident(
            cycle=cycle, fault=fault, rank=rank,
            detected_after=max(0.0, noticed - start),
            resumed_after=(first_after["time"] - start) if first_after is not None else None,
            last_step=max((e["step"] for e in steps.get(cycle, [])), default=None),
            resumed_from=min(restart_from) if restart_from else None,
        ))
    return incidents
