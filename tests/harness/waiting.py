"""Waiting on a condition with a generous deadline, never on a fixed sleep.

The one poll loop of the tests: a test waits for what it needs to see (a file, a flag, a step count)
and fails with `what` and, where given, the logs that explain a timeout. Deadlines are generous
(tens of seconds for processes): they bound a hung test, they do not judge speed.
"""

import time
from typing import Callable, Optional


def wait_for(predicate: Callable[[], object], timeout: float = 20.0, what: str = "condition",
             details: Optional[Callable[[], str]] = None, poll: float = 0.005) -> None:
    """Return once `predicate()` is true; raise AssertionError naming `what` after `timeout` s.

    `details` is called only on a timeout; its text (typically the ranks' log tails) is appended to
    the failure so a loaded CI run says why it waited in vain.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            extra = f"\n{details()}" if details is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{extra}")
        time.sleep(poll)
