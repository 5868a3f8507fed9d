"""Structured event log: one JSON object per line, shared by every part of nvrx-suite.

An incident report needs one timeline across the launcher, the node monitor and every
rank, so they all append to the same file (named by NVRX_EVENTS_FILE, which ft_launcher
sets for its workers). Each record carries wall time, rank, node and restart cycle.

Appends use O_APPEND and a single write() per line, so lines from concurrent processes do
not interleave. Readers skip lines that do not parse (a writer killed mid-line).
"""

import json
import logging
import os
import socket
import time
from typing import Any, Callable, Optional

EVENTS_FILE_ENV = "NVRX_EVENTS_FILE"

logger = logging.getLogger("nvrx.events")

# Well-known event kinds. Parts may add their own; these are the ones reports rely on.
FAULT_DETECTED = "fault_detected"
RANK_KILLED = "rank_killed"
STACKS_DUMPED = "stacks_dumped"
WORKERS_FAILED = "workers_failed"
RESTART_BEGUN = "restart_begun"
RENDEZVOUS_DONE = "rendezvous_done"
WORKERS_STARTED = "workers_started"
TRAINING_RESUMED = "training_resumed"
TRAINING_FINISHED = "training_finished"
LAUNCHER_EXIT = "launcher_exit"
HEALTH_CHECK = "health_check"
TIMEOUTS_UPDATED = "timeouts_updated"
CHECKPOINT_COMMITTED = "checkpoint_committed"
STRAGGLER_FOUND = "straggler_found"
STEP_DONE = "step_done"
FIRST_PROGRESS = "first_progress"  # the node monitor saw a cycle's first heartbeat / section end
FAULT_INJECTED = "fault_injected"


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


class EventLog:
    """Appends events to a JSON-lines file; with no path it only logs them (debug level)."""

    def __init__(
        self,
        path: Optional[str],
        *,
        rank: Optional[int] = None,
        node: Optional[str] = None,
        cycle: Optional[int] = None,
        source: Optional[str] = None,
        clock: Callable[[], float] = time.time,
    ):
        self.path = path
        self.rank = rank
        self.node = node if node is not None else socket.gethostname()
        self.cycle = cycle
        self.source = source
        self._clock = clock
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    @classmethod
    def from_env(cls, source: Optional[str] = None) -> "EventLog":
        """The event log of a worker process, as set up by ft_launcher (or a no-file log)."""
        return cls(
            os.environ.get(EVENTS_FILE_ENV),
            rank=_env_int("RANK"),
            cycle=_env_int("TORCHELASTIC_RESTART_COUNT"),
            source=source,
        )

    def emit(self, kind: str, **fields: Any) -> dict:
        record = {
            "time": self._clock(),
            "kind": kind,
            "rank": fields.pop("rank", self.rank),
            "node": self.node,
            "cycle": fields.pop("cycle", self.cycle),
        }
        if self.source:
            record["source"] = self.source
        record.update(fields)
        line = json.dumps(record, default=str) + "\n"
        logger.debug("event %s", line.rstrip())
        if self.path:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        return record


def read_events(path: str) -> list:
    """All well-formed events in `path`, in file order; a missing file reads as no events."""
    events = []
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(record, dict) and "kind" in record:
                    events.append(record)
    except FileNotFoundError:
        pass
    return events
