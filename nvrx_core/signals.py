"""Signals have one owner: a per-process registry of who handles which signal.

Several parts of the suite want signals: preemption records SIGTERM, the in-process
Wrapper interrupts its main thread with SIGUSR1, the fault-tolerance client and the
Wrapper have faulthandler dump every thread's stack on SIGUSR2. A signal has exactly one
disposition per process, so two parts installing handlers for the same signal silently
break one of them (the last one wins, and releasing restores the wrong handler). Every
part therefore claims its signals here, under an owner name:

    claim = default_registry().claim(signal.SIGTERM, "preemption", on_sigterm)
    ...
    claim.release()          # the disposition from before the claim is back

- A claim on a signal another owner holds is refused with SignalClaimError naming the
  signal and both owners (configure one of them to use another signal).
- A claim is a Python handler (any callable, or signal.SIG_IGN / SIG_DFL) or a
  FaultHandlerDump: faulthandler writes every thread's stack to a file from C, which works
  even when the main thread is stuck in C code and cannot run a Python handler.
- Stack dumps share a signal: several owners may claim the same signal for a
  FaultHandlerDump (the Wrapper and the fault-tolerance client both want SIGUSR2 to dump);
  the newest claim's destination is used, and releasing it brings the previous one back.
- The owner may re-claim its own signal with replace=True to change the action (e.g. move
  the stack dump from a file to stderr); the disposition restored on release stays the one
  from before its first claim.
- Python handlers are claimed and released on the main thread: Python installs them only
  there, so a claim elsewhere gets a clear SignalClaimError instead of a ValueError from
  deep inside. Stack dumps are installed from C and may be claimed from any thread (a
  client connecting from a helper thread), unless they displace a Python handler.
- A previous disposition set from C (not visible to Python) is restored as SIG_DFL when a
  Python handler is released; faulthandler restores its own predecessor exactly.

A signal given by a user (a config field, an adapter's argument, an environment variable)
is read by one rule, parse_signal: a signal.Signals, a number, or a name with or without
"SIG" in any case; every config and adapter takes signals through it.

Signal dispositions are per process, so this is the one legitimate per-process object:
default_registry() returns the current process's registry, and a forked child (a warm
start worker, a DataLoader worker) starts with an empty one, since the claims it inherited
belong to code that is not running in it. Tests and embedders may build their own
SignalRegistry instances.
"""

import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import threading
from typing import IO, Any, Callable, Dict, List, Optional, Union

from nvrx_core.config import ConfigError

logger = logging.getLogger("nvrx.signals")


def parse_signal(value: Any, what: str) -> signal.Signals:
    """The signal a user named, by the one rule every config and adapter applies: a
    signal.Signals; its number (an int, or digits as a command line or YAML gives them); its
    name with or without the SIG prefix, in any case ("SIGTERM", "TERM", "sigterm").
    Anything else raises ConfigError naming `what` (the field or argument) and the value, so
    one spelling is never accepted in one place and refused in another. Whether the signal
    suits the use (catchable, distinct from another field) is the caller's rule."""
    if isinstance(value, signal.Signals):
        return value
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            return signal.Signals(value)
        if isinstance(value, str) and value.strip():
            text = value.strip().upper()
            if text.isdigit():
                return signal.Signals(int(text))
            return signal.Signals[text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        pass
    raise ConfigError(f"{what}={value!r}: is not a signal name or number known to this platform "
                      f"(e.g. SIGTERM, TERM, sigterm or {int(signal.SIGTERM)})")


class SignalClaimError(RuntimeError):
    """A claim or release that the registry refuses (conflict, wrong thread, not held)."""


@dataclasses.dataclass(frozen=True)
class FaultHandlerDump:
    """Claim action: faulthandler dumps the stacks to `file` (None: sys.stderr at claim
    time). The file must stay open while the claim is held (faulthandler keeps its fd)."""

    file: Optional[IO[str]] = None
    all_threads: bool = True
    chain: bool = False


Action = Union[Callable[[int, Any], Any], signal.Handlers, FaultHandlerDump]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclasses.dataclass
class SignalClaim:
    """One owner's hold on one signal; release() gives the signal back."""

    registry: "SignalRegistry"
    signum: int
    owner: str
    action: Action

    @property
    def held(self) -> bool:
        return self in self.registry._stack(self.signum)

    def release(self) -> None:
        """Give the signal back (see SignalRegistry.release). Safe to call more than once."""
        self.registry.release(self)


class SignalRegistry:
    """Who holds which signal in this process, and the dispositions to restore.

    Per signal, a stack of claims: one Python handler, or any number of stack dumps
    (FaultHandlerDump) from different owners. Dumps share: every owner of a dump wants
    the stacks written, so a newer dump claim takes over the destination and the older
    one's comes back when the newer is released. A Python handler shares with nobody.
    """

    def __init__(self) -> None:
        self._claims: Dict[int, List[SignalClaim]] = {}
        self._previous: Dict[int, Any] = {}
        self._lock = threading.RLock()  # a handler running between two bytecodes may claim too

    def claim(self, signum: int, owner: str, action: Action, *, replace: bool = False) -> SignalClaim:
        """Install `action` for `signum` on behalf of `owner`; see the module docstring."""
        signum = int(signum)
        name = _signal_name(signum)
        _check_action(action)
        if not owner:
            raise ValueError("a signal claim needs an owner name")
        with self._lock:
            stack = self._stack(signum)
            mine = [c for c in stack if c.owner == owner]
            if mine and not replace:
                raise SignalClaimError(f"{owner} already holds {name} (pass replace=True to change the action)")
            others = [c for c in stack if c.owner != owner]
            dumps_only = _is_dump(action) and all(_is_dump(c.action) for c in others)
            if others and not dumps_only:
                held = others[-1]
                raise SignalClaimError(
                    f"{owner} cannot claim {name}: it is held by {held.owner} ({_describe(held.action)}). "
                    f"Two parts of the job need the same signal; configure one of them to use another signal.")
            if not (_is_dump(action) and all(_is_dump(c.action) for c in stack)):
                _require_main_thread(f"{owner} cannot claim {name}")
            if not stack:
                self._previous[signum] = signal.getsignal(signum)
            elif _is_dump(stack[-1].action) or _is_dump(action):
                self._uninstall(stack[-1])  # faulthandler's registration is undone by faulthandler
            # else one Python disposition replaces another at once: undoing it first would pass
            # through the previous one, and a signal in between would get the default action
            if mine:
                stack.remove(mine[0])
            claim = SignalClaim(self, signum, owner, action)
            stack.append(claim)
            self._claims[signum] = stack
            _install(signum, action)
        logger.debug("%s claimed %s (%s)", owner, name, _describe(action))
        return claim

    def release(self, claim: SignalClaim) -> None:
        """Withdraw `claim`: the claim below it (a shared dump) or, when it was the last, the
        disposition from before the first claim comes back. No-op if not held."""
        with self._lock:
            stack = self._stack(claim.signum)
            if claim not in stack:
                return
            if not _is_dump(claim.action):
                _require_main_thread(f"{claim.owner} cannot release {_signal_name(claim.signum)}")
            top = stack[-1] is claim
            stack.remove(claim)
            if top:
                self._uninstall(claim)
                if stack:
                    _install(claim.signum, stack[-1].action)
            if not stack:
                del self._claims[claim.signum], self._previous[claim.signum]
        logger.debug("%s released %s", claim.owner, _signal_name(claim.signum))

    def _uninstall(self, claim: SignalClaim) -> None:
        """Put back what `claim` replaced: faulthandler restores the C-level handler it saved;
        a Python handler gives way to the disposition from before the first claim."""
        if _is_dump(claim.action):
            faulthandler.unregister(claim.signum)
        else:
            previous = self._previous[claim.signum]
            signal.signal(claim.signum, previous if previous is not None else signal.SIG_DFL)

    def _stack(self, signum: int) -> List[SignalClaim]:
        return self._claims.get(int(signum), [])

    def owner(self, signum: int) -> Optional[str]:
        """Whose action a delivery of `signum` runs now, or None."""
        stack = self._stack(signum)
        return stack[-1].owner if stack else None

    def is_free(self, signum: int) -> bool:
        """No owner here and no Python handler from elsewhere (the disposition is the default)."""
        return not self._stack(signum) and signal.getsignal(int(signum)) == signal.SIG_DFL

    def owners(self) -> Dict[str, List[str]]:
        """{signal name: [owners, oldest first]} for every held signal (for logs and reports)."""
        return {_signal_name(s): [c.owner for c in st] for s, st in sorted(self._claims.items())}


def _check_action(action: Action) -> None:
    if not (isinstance(action, FaultHandlerDump) or callable(action)
            or action in (signal.SIG_IGN, signal.SIG_DFL)):
        raise TypeError(f"a signal claim's action must be a callable, SIG_IGN, SIG_DFL or "
                        f"FaultHandlerDump, not {action!r}")


def _describe(action: Action) -> str:
    if isinstance(action, FaultHandlerDump):
        return f"stack dump to {getattr(action.file, 'name', 'stderr') if action.file else 'stderr'}"
    if action in (signal.SIG_IGN, signal.SIG_DFL):
        return signal.Handlers(action).name
    return f"handler {getattr(action, '__qualname__', repr(action))}"


def _install(signum: int, action: Action) -> None:
    if isinstance(action, FaultHandlerDump):
        faulthandler.register(signum, file=action.file or sys.stderr,
                              all_threads=action.all_threads, chain=action.chain)
    else:
        signal.signal(signum, action)


def _is_dump(action: Action) -> bool:
    return isinstance(action, FaultHandlerDump)


def _require_main_thread(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise SignalClaimError(f"{what} from thread {threading.current_thread().name!r}: signal "
                               f"handlers are installed and run only on the main thread")


_default: Optional[SignalRegistry] = None
_default_pid: Optional[int] = None
_default_lock = threading.Lock()


def default_registry() -> SignalRegistry:
    """This process's registry (a forked child gets a new, empty one)."""
    global _default, _default_pid
    with _default_lock:
        if _default is None or _default_pid != os.getpid():
            _default, _default_pid = SignalRegistry(), os.getpid()
        return _default


STOP_REQUEST_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
"""Signals that reach every process of a job to ask it to stop: Slurm's --signal (SIGTERM, or
the one it names) goes to every process of the job step, a terminal's ^C and hang-up to its
whole foreground group. The default action of each ends the process."""


def ignore_stop_requests(owner: str, registry: Optional[SignalRegistry] = None) -> List[SignalClaim]:
    """Ignore STOP_REQUEST_SIGNALS in a helper process whose parent decides when it stops (the
    node monitor, the warm-start fork server): a stop request to the whole job must reach the
    parent and the workers, and must not take the helpers the parent still needs while its
    workers save. Returns the claims (release them to undo)."""
    registry = registry if registry is not None else default_registry()
    claims: List[SignalClaim] = []
    try:
        for number in STOP_REQUEST_SIGNALS:
            claims.append(registry.claim(number, owner, signal.SIG_IGN))
    except BaseException:
        for claim in reversed(claims):
            claim.release()
        raise
    return claims
