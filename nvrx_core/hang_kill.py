"""How a monitor takes down a process it judged hung: one rule, shared by both monitors.

ft_launcher's node monitor (`ft/kills.py`) and the in-process Wrapper's monitor process
(`inprocess/monitor_process.py`) both end a hung rank the same way:

1. Stack dump: the dump signal (faulthandler in the rank) is sent, and the dump counts as
   written (DumpWatch) once the rank took the signal and its dump file, where it has one,
   grew and then held still for DUMP_POLL; first looked at `stack_dump_grace` after the
   signal, at most DUMP_WAIT_LIMIT. A fixed grace was not enough: on a loaded node a rank
   can take the signal, or take it and then wait for a core before its handler writes,
   and a kill meanwhile lost the stacks that name the culprit. A stopped (SIGSTOP) rank
   writes nothing until continued, so nobody waits for its dump.
2. Termination (terminate): the termination signal, then SIGCONT. A stopped process runs
   no signal handler until continued, so a rank with a SIGTERM handler (the in-process
   Wrapper's, a training script's) would otherwise sit stopped until step 3.
3. Escalation (escalate): SIGKILL if the process is still there `termination_grace` later.

Every signal goes through a ProcessHandle (nvrx_core.proc): a pidfd opened while the process
was known to be the rank, so no step can reach an unrelated process that reused the pid.
The node monitor serves every rank of a node from one loop, so it runs these steps on its
scheduler (DumpWatch, terminate, escalate); the in-process monitor watches one rank and
runs them in order (dump_stacks, terminate_then_kill).
"""

import dataclasses
import signal
import time
from typing import Callable, Optional

from nvrx_core.proc import ProcessHandle, process_state

DUMP_WAIT_LIMIT = 5.0
"""Seconds a stack dump may take (signal untaken, file still growing) before the rank is terminated anyway."""
DUMP_POLL = 0.05
"""Seconds between looks at a dump being written (signal pending? file still growing?)."""
EXIT_POLL = 0.02
"""Seconds between looks at a terminated process, while its grace runs (blocking path)."""
STOPPED_STATES = ("stopped", "tracing stop")
"""process_state() of a process that runs nothing until continued."""
_UNTAKEN = -1  # a dump size that stands for "the signal was not taken yet"

Send = Callable[[int], bool]
"""Deliver a signal to the one process meant (a ProcessHandle's send_signal); False once it is gone."""
Clock = Callable[[], float]
Sleep = Callable[[float], None]


@dataclasses.dataclass
class DumpWatch:
    """One process's stack dump being written, looked at every DUMP_POLL (see the module docstring)."""

    sent: float
    """When the dump signal was sent (the monitor's clock)."""
    before: Optional[int]
    """The dump file's size when the signal was sent (None: no file, the dump goes to stderr)."""
    last: Optional[int] = None
    """The size at the previous look (_UNTAKEN while the signal was not taken)."""

    def __post_init__(self) -> None:
        self.last = self.before

    def look(self, pending: bool, state: Optional[str], size: Optional[int]) -> bool:
        """Whether the dump counts as written now. `pending`: the dump signal not taken yet;
        `state`: process_state() of the process; `size`: its dump file's size now (None: no file)."""
        size = _UNTAKEN if pending else size
        if state in STOPPED_STATES:  # it writes nothing until continued
            written = True
        elif size is None:  # no file to watch: taken, and taken at the previous look too
            written = self.last != _UNTAKEN
        else:  # grew since the signal (from nothing: no file then), and held still since the last look
            written = (self.before or 0) < size == self.last
        self.last = size
        return written

    def overdue(self, now: float) -> bool:
        """DUMP_WAIT_LIMIT has passed since the signal: terminate without the dump."""
        return now - self.sent >= DUMP_WAIT_LIMIT


def terminate(send: Send, sig: int) -> bool:
    """Send the termination signal `sig`, then SIGCONT so a stopped process acts on it.
    False when the process was already gone (nothing sent)."""
    if not send(sig):
        return False
    send(signal.SIGCONT)
    return True


def escalate(send: Send) -> bool:
    """SIGKILL, `termination_grace` after terminate(); False when the process is gone by then."""
    return send(signal.SIGKILL)


def dump_stacks(process: ProcessHandle, sig: int, grace: float, dump_size: Callable[[], Optional[int]] = lambda: None,
                clock: Clock = time.monotonic, sleep: Sleep = time.sleep) -> bool:
    """Send the dump signal `sig` and block until the dump is written (DumpWatch), at most
    DUMP_WAIT_LIMIT. True if it was written, False if not (or the process is gone)."""
    before = dump_size()
    if not process.send_signal(sig):
        return False
    watch = DumpWatch(sent=clock(), before=before)
    sleep(grace)
    while True:
        if process.exited():
            return False
        if watch.look(process.signal_pending(sig), process_state(process.pid), dump_size()):
            return True
        if watch.overdue(clock()):
            return False
        sleep(DUMP_POLL)


def terminate_then_kill(process: ProcessHandle, sig: int, grace: float, still_ours: Callable[[], bool] = lambda: True,
                        clock: Clock = time.monotonic, sleep: Sleep = time.sleep) -> bool:
    """terminate() `process`, wait up to `grace` seconds for it to exit, then escalate().
    `still_ours`: an extra proof that a bare-pid handle (no pidfd) still names the process.
    True if SIGKILL had to be sent."""
    if not terminate(process.send_signal, sig) or sig == signal.SIGKILL:
        return False
    deadline = clock() + grace
    while clock() < deadline and not process.exited() and still_ours():
        sleep(EXIT_POLL)
    if process.exited() or not still_ours():
        return False
    return escalate(process.send_signal)
