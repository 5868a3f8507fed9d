"""Respawns (ft_launcher --ft-restart-policy respawn-rank): one dead rank replaced, the others
kept running. Not a failed restart cycle (no cycle ends), so they are their own incident kind,
with their own clock: the agent saw the death, the replacement process started, it joined the
others' in-process job, and it called the training function with them. A death the launcher
declined to respawn is listed with its reason; its restart is an ordinary incident."""

import dataclasses
from typing import List, Optional

from nvrx_core import events as ev



@dataclasses.dataclass
class Respawn:
    rank: int
    cycle: Optional[int]
    exit_code: Optional[int]
    old_pid: Optional[int] = None
    new_pid: Optional[int] = None
    seen_time: Optional[float] = None
    """The agent saw the worker's death."""
    started_time: Optional[float] = None
    """The replacement process was started."""
    joined_time: Optional[float] = None
    resumed_time: Optional[float] = None
    """The replacement called the training function with the others."""
    declined: Optional[str] = None

    def span(self, end: Optional[float]) -> Optional[float]:
        return None if end is None or self.seen_time is None else max(0.0, end - self.seen_time)


def find_respawns(events: List[dict]) -> List[Respawn]:
    """Every respawn and declined respawn, in time order."""
    found = []
    for i, e in enumerate(events):
        if e["kind"] == ev.RESPAWN_DECLINED:
            found.append(Respawn(e.get("rank"), e.get("cycle"), e.get("exit_code"), seen_time=e["time"],
                                 declined=str(e.get("reason", ""))))
        elif e["kind"] == ev.RANK_RESPAWNED:
            seconds = e.get("seconds") if isinstance(e.get("seconds"), (int, float)) else 0.0
            respawn = Respawn(e.get("rank"), e.get("cycle"), e.get("exit_code"), e.get("old_pid"), e.get("new_pid"),
                              seen_time=e["time"] - seconds, started_time=e["time"])
            later = [x for x in events[i + 1:] if x.get("rank") == respawn.rank]
            joined = next((x for x in later if x["kind"] == ev.INPROCESS_REPLACEMENT_JOINED), None)
            if joined is not None:
                respawn.joined_time = joined["time"]
                resumed = next((x for x in later if x["kind"] == ev.INPROCESS_RESTARTED and x["time"] >= joined["time"]), None)
                respawn.resumed_time = resumed["time"] if resumed is not None else None
            found.append(respawn)
    return found


def describe_respawn(r: Respawn) -> str:
    head = f"cycle {r.cycle}: rank {r.rank}"
    if r.declined is not None:
        return f"{head} died (exit {r.exit_code}); not respawned: {r.declined} (every rank restarts)"

    def s(value: Optional[float]) -> str:
        return "?" if value is None else f"{value:.2f} s"

    return (f"{head} (pid {r.old_pid}) died (exit {r.exit_code}); replacement pid {r.new_pid} started "
            f"{s(r.span(r.started_time))}, joined {s(r.span(r.joined_time))}, training with the others "
            f"{s(r.span(r.resumed_time))} after the death was seen; no other rank restarted")
