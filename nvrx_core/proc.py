"""What Linux /proc says about another process: the monitors' view of a rank they may kill.

Both monitors (ft_launcher's node monitor, the in-process Wrapper's monitor process) ask a
hung rank for a stack dump before killing it (nvrx_core.hang_kill owns that sequence). On a
loaded node the rank may not run for a while after the dump signal is sent; a termination
signal sent meanwhile is taken first and the dump is lost. signal_pending() and
process_state() let them wait for the rank to take the signal instead.

ProcessHandle names a process by pidfd (Linux >= 5.3): a pid alone names whichever process
holds the number now, and once a rank has exited and been reaped its number can go to an
unrelated process, which a late SIGKILL would then hit. A pidfd always refers to the
process it was opened for; signalling it after that process is gone does nothing.
"""

import errno
import os
import select
import signal
from typing import Optional


def _status(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def alive(pid: int) -> bool:
    """Running or stopped (a zombie counts as gone)."""
    try:
        state = _status(pid).get("State", "").split()
    except OSError:
        return False
    return bool(state) and state[0] != "Z"


def process_state(pid: int) -> Optional[str]:
    """The kernel's word for what `pid` is doing ("running", "sleeping", "stopped", ...), or None
    once it is gone: a hang report tells a frozen (SIGSTOP) rank from one blocked or spinning."""
    try:
        state = _status(pid).get("State", "").split()
    except OSError:
        return None
    return state[1].strip("()") if len(state) > 1 else None


def process_start_time(pid: int) -> Optional[float]:
    """When `pid` started, in wall-clock seconds (None where /proc cannot say): a run's wall
    time counts from the launcher's start, its imports included."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def signal_pending(pid: int, sig: int) -> bool:
    """Whether `sig` was sent to `pid` and not taken yet (False where unknown or gone).

    A stopped process (SIGSTOP) takes no signal, so for it nothing counts as pending.
    """
    try:
        fields = _status(pid)
        if fields.get("State", "").split()[:1] in (["T"], ["t"], ["Z"]):
            return False
        bit = 1 << (int(sig) - 1)
        return any(int(fields[name], 16) & bit for name in ("SigPnd", "ShdPnd") if name in fields)
    except (OSError, ValueError):
        return False


class ProcessHandle:
    """One process, held by pidfd, so a signal reaches that process or none at all.

    Open it while the process is known to be the right one (a monitor: right after reading
    the connecting peer's SO_PEERCRED pid). Where the kernel has no pidfds (ENOSYS, or a
    seccomp filter says EPERM) the handle falls back to the bare pid; `by_pidfd` says which,
    so a caller can be more careful with a bare pid (stop signalling it once the process
    may have gone).
    """

    def __init__(self, pid: int, pidfd: Optional[int]):
        self.pid = pid
        self._pidfd = pidfd

    @classmethod
    def open(cls, pid: int) -> "ProcessHandle":
        """A handle on `pid`; ProcessLookupError if there is no such process."""
        if pid <= 0:
            raise ProcessLookupError(f"no process can have pid {pid}")
        try:
            return cls(pid, os.pidfd_open(pid))
        except ProcessLookupError:
            raise
        except (AttributeError, OSError) as e:  # no pidfd_open in this Python / kernel / sandbox
            if isinstance(e, OSError) and e.errno not in (errno.ENOSYS, errno.EPERM, errno.EACCES):
                raise
            if not alive(pid):
                raise ProcessLookupError(f"no process {pid}") from None
            return cls(pid, None)

    @property
    def by_pidfd(self) -> bool:
        return self._pidfd is not None

    def fileno(self) -> int:
        """The pidfd (to pass to another process, which can then hold the same process); -1 if none."""
        return -1 if self._pidfd is None else self._pidfd

    def send_signal(self, sig: int) -> bool:
        """Send `sig`; False if the process has exited (or the handle was closed)."""
        if self._pidfd is None:
            if self.pid <= 0:
                return False
            try:
                os.kill(self.pid, sig)
                return True
            except ProcessLookupError:
                return False
        if self.exited():  # a zombie still "takes" a signal; it is gone all the same
            return False
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
            return True
        except ProcessLookupError:
            return False

    def exited(self) -> bool:
        """Whether the process has exited (a zombie counts as exited)."""
        if self._pidfd is None:
            return self.pid <= 0 or not alive(self.pid)
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def signal_pending(self, sig: int) -> bool:
        """signal_pending() for this very process (False once it has exited)."""
        return not self.exited() and signal_pending(self.pid, sig)

    def close(self) -> None:
        """Release the pidfd; the handle then signals nothing."""
        if self._pidfd is not None:
            os.close(self._pidfd)
        self._pidfd, self.pid = None, -1

    def __repr__(self) -> str:
        return f"ProcessHandle(pid={self.pid}, pidfd={self._pidfd})"
