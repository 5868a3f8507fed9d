"""What the node monitor knows about one rank, and when that rank counts as hung.

Kept apart from the monitor's I/O so the deadline rules can be read (and tested) on their own.
A rank's view reaches the monitor two ways: one message per call on the hot path (hb, ss,
se, ...), or one `state` message carrying the rank's whole view (after a reconnect to a
restarted monitor, or after the rank could not send for a while). apply_state() makes the
monitor's view exactly the rank's, with the same deadlines as if no message had been lost.
"""

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from nvrx_core.config import ConfigError
from nvrx_core.ft.protocol import ProtocolError
from nvrx_core.ft.timeouts import Timeouts
from nvrx_core.proc import ProcessHandle

REREGISTER_REASON = "did not re-register with the restarted node monitor"


@dataclasses.dataclass
class RankWatch:
    """What the monitor knows about one connected (or adopted) rank."""

    rank: int
    local_rank: int
    pid: int
    cycle: int
    connected_at: float
    timeouts: Timeouts
    last_heartbeat: Optional[float] = None
    heartbeats: int = 0
    open_sections: Dict[str, float] = dataclasses.field(default_factory=dict)
    uses_sections: bool = False
    last_section_end: Optional[float] = None
    section_ends: int = 0
    max_iteration: Optional[int] = None
    workload_request: Optional[str] = None
    """What the rank asked the launcher to do at the next failure (WORKLOAD_ACTIONS), if anything."""
    expired: bool = False
    proc: Optional[ProcessHandle] = None
    """The rank's process, by pidfd: every signal goes through it."""
    reregister_by: Optional[float] = None
    """Adopted from a monitor that died: the rank must connect again before this moment."""
    connected: bool = True
    pending: List = dataclasses.field(default_factory=list)
    """Scheduled kill steps not yet run (cancelled when the rank's process has exited)."""


def cycle_stats(cycle: int, watches: List[RankWatch], adopted: List[RankWatch]) -> dict:
    """What the ranks of restart cycle `cycle` did (`watches`: its registrations; `adopted`: ranks
    a restarted monitor waited for): progress for the launcher's no-progress check, the ranks'
    workload requests, and the pids this monitor took down as hung (respawn-rank's policy never
    replaces those: a hang goes through a restart of every rank)."""
    iterations = [w.max_iteration for w in watches if w.max_iteration is not None]
    return {
        "cycle": cycle,
        "ranks": len(watches),
        "heartbeats": sum(w.heartbeats for w in watches),
        "section_ends": sum(w.section_ends for w in watches),
        "max_iteration": max(iterations) if iterations else None,
        "workload_requests": {str(w.rank): w.workload_request for w in watches if w.workload_request},
        "hung_pids": sorted({w.pid for w in watches if w.expired}
                            | {w.pid for w in adopted if w.expired and w.cycle == cycle}),
    }


def next_deadline(w: RankWatch) -> Optional[Tuple[float, str]]:
    """The earliest moment `w` counts as hung, and why; None if nothing is enforced.

    Heartbeat deadlines apply unless the rank chose section mode (opened a section and
    never sent a heartbeat). Section deadlines apply to each open section; with none open,
    the out-of-section timeout runs from the last section end (or the connection).
    """
    if w.reregister_by is not None:
        return w.reregister_by, REREGISTER_REASON
    t = w.timeouts
    candidates: List[Tuple[float, str]] = []
    if w.last_heartbeat is None:
        if t.initial_heartbeat is not None and not w.uses_sections:
            candidates.append((w.connected_at + t.initial_heartbeat, "no initial heartbeat"))
    elif t.heartbeat is not None:
        candidates.append((w.last_heartbeat + t.heartbeat, "heartbeat timeout"))
    if w.open_sections:
        for name, started in w.open_sections.items():
            limit = t.sections.get(name)
            if limit is not None:
                candidates.append((started + limit, f"section '{name}' timeout"))
    elif t.out_of_section is not None:
        since = w.last_section_end if w.last_section_end is not None else w.connected_at
        candidates.append((since + t.out_of_section, "out-of-section timeout"))
    return min(candidates) if candidates else None


def reregister_grace(configured: Timeouts, floor: float) -> float:
    """How long a rank adopted from a dead monitor has to connect to the new one.

    A live rank re-registers within a second or two (its client reconnects from a thread of
    its own), so only a frozen rank (SIGSTOP, a C call holding the GIL) misses it. The
    longest configured timeout, and never less than `floor`, leaves no live rank at risk.
    """
    values = [configured.heartbeat, configured.out_of_section, *configured.sections.values()]
    return max([floor] + [v for v in values if v is not None])


def _age(msg: dict, field: str) -> Optional[float]:
    value = msg.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ProtocolError(f"state: {field} must be a number of seconds >= 0, got {value!r:.80}")
    return float(value)


def _count(msg: dict, field: str) -> int:
    value = msg.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError(f"state: {field} must be an integer >= 0, got {value!r:.80}")
    return value


def apply_state(w: RankWatch, msg: dict, now: float, configured: Timeouts) -> bool:
    """Make `w` the rank's own view at `now` (ages are relative to when the rank sent it, so
    a late message only ever extends a deadline). Return whether its timeouts changed.
    Validates everything first: a bad message changes nothing."""
    since_init = _age(msg, "since_init")
    hb_age, se_age = _age(msg, "hb_age"), _age(msg, "se_age")
    heartbeats, section_ends = _count(msg, "heartbeats"), _count(msg, "section_ends")
    open_sections = msg.get("open")
    if not isinstance(open_sections, dict) or not all(isinstance(k, str) for k in open_sections):
        raise ProtocolError("state: open must map section names to ages")
    open_ages = {name: _age(open_sections, name) for name in open_sections}
    if any(age is None for age in open_ages.values()):
        raise ProtocolError("state: open section ages must be numbers")
    iteration = msg.get("iteration")
    if iteration is not None and (isinstance(iteration, bool) or not isinstance(iteration, int)):
        raise ProtocolError(f"state: iteration must be an integer or null, got {iteration!r:.80}")
    timeouts = w.timeouts
    if msg.get("timeouts") is not None:
        try:
            timeouts = configured.overridden_by(Timeouts.from_json(msg["timeouts"], source="state.timeouts"))
        except ConfigError as e:
            raise ProtocolError(str(e)) from None

    if since_init is not None:
        w.connected_at = now - since_init
    w.heartbeats = max(w.heartbeats, heartbeats)
    w.last_heartbeat = None if hb_age is None else now - hb_age
    w.uses_sections = w.uses_sections or bool(msg.get("sections_used")) or bool(open_ages)
    w.open_sections = {name: now - age for name, age in open_ages.items()}
    w.section_ends = max(w.section_ends, section_ends)
    if se_age is not None:
        w.last_section_end = now - se_age
    if iteration is not None:
        w.max_iteration = max(iteration, w.max_iteration if w.max_iteration is not None else -1)
    changed = timeouts != w.timeouts
    w.timeouts = timeouts
    return changed


def parse_adopt(spec: str) -> Dict[int, Tuple[int, int]]:
    """'RANK:PID:PIDFD,...' (the monitor's --adopt flag) as {rank: (pid, pidfd)}; ValueError names
    the bad item. The pidfds are inherited from the launcher, which opened them at worker start."""
    out: Dict[int, Tuple[int, int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            rank, pid, pidfd = (int(x) for x in item.split(":"))
            if rank < 0 or pid <= 0 or pidfd < 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"--adopt item {item!r}: expected RANK:PID:PIDFD") from None
        out[rank] = (pid, pidfd)
    return out
