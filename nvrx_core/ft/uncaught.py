"""Records the exception that ends a rank, so an incident report can say who raised first.

When one rank raises, its peers soon fail too, in the collective they were waiting in
("Connection closed by peer", an NCCL abort): every rank exits 1 and exit codes cannot tell
the culprit from the victims. The exception's type, text and time can. RankMonitorClient
installs this hook for the life of its monitoring; it writes one `worker_exception` event
and hands the exception on to the hook that was there before (normally Python's, which
prints the traceback).
"""

import sys
import traceback
from typing import Any, Optional

from nvrx_core import events as ev

MAX_MESSAGE_CHARS = 2000
MAX_TRACEBACK_CHARS = 6000


class UncaughtExceptionRecorder:
    def __init__(self, events: ev.EventLog):
        self._events = events
        self._previous: Optional[Any] = None

    def install(self) -> None:
        if self._previous is None:
            self._previous, sys.excepthook = sys.excepthook, self._hook

    def uninstall(self) -> None:
        """Put back the previous hook, unless someone replaced ours meanwhile (theirs stays)."""
        if self._previous is not None and sys.excepthook == self._hook:
            sys.excepthook = self._previous
        self._previous = None

    def _hook(self, exc_type, exc, tb) -> None:
        try:
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            self._events.emit(
                ev.WORKER_EXCEPTION,
                type=f"{exc_type.__module__}.{exc_type.__qualname__}",
                message=str(exc)[:MAX_MESSAGE_CHARS],
                traceback=text[-MAX_TRACEBACK_CHARS:],
            )
        finally:
            (self._previous or sys.__excepthook__)(exc_type, exc, tb)
