"""What happened in a restart iteration: interruption records and event kinds.

Records travel through the store as JSON, so every rank (and the rank that decides the
next assignment) sees the same facts: who was interrupted, how, and whether it was the
cause or a consequence (a peer's collective failing because another rank died).
"""

import dataclasses
import enum
import json
from typing import Optional



class Cause(str, enum.Enum):
    EXCEPTION = "exception"            # the wrapped function raised
    SOFT_TIMEOUT = "soft_timeout"      # no progress while the GIL was free
    PEER_INTERRUPTED = "peer_interrupted"  # another rank's fault reached this rank
    HARD_TIMEOUT = "hard_timeout"      # monitor process killed the rank
    EXITED = "exited"                  # the process died (killed, crashed)
    HEARTBEAT_LOST = "heartbeat_lost"  # no heartbeat within heartbeat_timeout (rank or node gone)
    COMPLETION_TIMEOUT = "completion_timeout"
    HEALTH_CHECK = "health_check"      # failed a health check after the fault
    MAX_RANK_FAULTS = "max_rank_faults"


# Causes that mean the process is gone (or must go) for good.
TERMINAL_CAUSES = frozenset({Cause.HARD_TIMEOUT, Cause.EXITED, Cause.HEARTBEAT_LOST, Cause.HEALTH_CHECK})


@dataclasses.dataclass(frozen=True)
class InterruptionRecord:
    rank: int                 # initial rank the record is about
    cause: Cause
    detail: str = ""
    reporter: Optional[int] = None  # initial rank that wrote it (differs for heartbeat_lost)
    first: bool = False       # no other interruption was known when it was written

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "cause": self.cause.value, "detail": self.detail[:2000],
                           "reporter": self.reporter, "first": self.first})

    @classmethod
    def from_json(cls, text) -> "InterruptionRecord":
        data = json.loads(text)
        return cls(int(data["rank"]), Cause(data["cause"]), data.get("detail", ""), data.get("reporter"),
                   bool(data.get("first", False)))
