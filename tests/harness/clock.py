"""A clock the test advances: decisions about time (a timeout firing) without real time passing.

`NodeMonitor(clock=...)` reads its deadlines from this; a test moves it past a deadline and waits
for the monitor's next polls, so whether a timeout fired is decided by the monitor's rule alone,
never by how fast a loaded machine woke a thread.
"""

import dataclasses
import threading


@dataclasses.dataclass
class FakeClock:
    """Monotonic seconds that move only when the test calls advance()."""

    now: float = 1000.0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"FakeClock.advance: seconds={seconds} is negative (a monotonic clock)")
        with self._lock:
            self.now += seconds
