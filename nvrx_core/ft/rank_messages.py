"""What each of a rank's messages means for the node monitor's record of that rank (its RankWatch).

Kept apart from monitor.py, which serves the sockets and enforces: a heartbeat, a section's
start or end, progress, calculated timeouts, the rank's whole `state` and a workload request
(`wc`) change only that rank's watch (and add to the event log), with no I/O and nothing of
the other ranks, so the protocol's meaning reads on its own. The messages that concern the
connection, the cycle or other ranks (init, bye, collectives, the launcher's control messages)
and the cycle's first-progress event stay in the monitor.

Imports stdlib and nvrx_core's torch-free modules only, as the monitor does.
"""

from nvrx_core import events as ev
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.protocol import WORKLOAD_ACTIONS, ProtocolError
from nvrx_core.ft.timeouts import Timeouts
from nvrx_core.ft.watch import RankWatch, apply_state

WATCH_MESSAGES = frozenset({"hb", "ss", "se", "sea", "progress", "timeouts", "state", "wc"})
"""The rank messages apply_to_watch() handles."""


def apply_to_watch(w: RankWatch, msg: dict, now: float, cfg: FTConfig, events: ev.EventLog) -> None:
    """Apply one of WATCH_MESSAGES (`msg["t"]`) from rank `w` received at `now`. A malformed
    message raises ProtocolError (or ValueError) before it changes anything."""
    kind = msg["t"]
    if kind == "hb":
        w.last_heartbeat = now
        w.heartbeats += 1
    elif kind == "ss":
        w.uses_sections = True
        w.open_sections[msg["name"]] = now
    elif kind == "se":
        if w.open_sections.pop(msg["name"], None) is not None:
            w.section_ends += 1
            if not w.open_sections:
                w.last_section_end = now
    elif kind == "sea":
        if w.open_sections:
            w.open_sections.clear()
            w.section_ends += 1
            w.last_section_end = now
    elif kind == "progress":
        w.max_iteration = max(msg["iteration"], w.max_iteration if w.max_iteration is not None else -1)
    elif kind == "timeouts":
        calculated = Timeouts.from_json(msg["timeouts"], source="timeouts message")
        w.timeouts = w.timeouts.overridden_by(calculated)
        events.emit(ev.TIMEOUTS_UPDATED, rank=w.rank, cycle=w.cycle, timeouts=w.timeouts.to_json())
    elif kind == "state":
        if apply_state(w, msg, now, Timeouts.from_config(cfg)):
            events.emit(ev.TIMEOUTS_UPDATED, rank=w.rank, cycle=w.cycle, timeouts=w.timeouts.to_json())
    elif kind == "wc":
        if msg["action"] not in WORKLOAD_ACTIONS:
            raise ProtocolError(f"wc: action {msg['action']!r:.60} is not one of {', '.join(WORKLOAD_ACTIONS)}")
        w.workload_request = msg["action"]
        events.emit(ev.WORKLOAD_REQUEST, rank=w.rank, cycle=w.cycle, action=msg["action"],
                    reason=str(msg.get("reason", ""))[:500])
    else:
        raise ProtocolError(f"{kind} is not one of the messages that update a rank's watch")
