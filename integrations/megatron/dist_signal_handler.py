"""Megatron's DistributedSignalHandler, on nvrx_core.preemption.

Megatron-LM's training loop enters `DistributedSignalHandler(sig)` once and, at its exit
check, asks `any(handler.signals_received())` (one flag per rank, gathered on every rank)
before saving a checkpoint and leaving. The names and answers are Megatron's; underneath:

- The signal is claimed from nvrx_core.signals' registry (owner "preemption"), the one
  owner of signal dispositions in a process, so a second part wanting the same signal
  (the in-process Wrapper's interrupt, another handler) is refused with an error naming
  both owners instead of silently replacing one of them; release() restores exactly what
  was there before.
- The gather runs through nvrx_core.collectives on the process group's device: CPU for
  gloo, never torch.cuda on that path (Megatron's picks the device from a global backend).
- Entering twice without release() is refused (Megatron's would save its own handler as
  "the original" and never restore the real one); entering again after release() starts
  with no signal recorded.
- Once any rank reports a signal, the core handler counts it as the agreed preemption:
  `handler.core.should_stop(step)` and its `exit_preempted()` (exit 18, "requeue me")
  follow from it, for loops that want the suite's exit code.
"""

import signal
from typing import Any, List, Optional, Union

from nvrx_core.config import ConfigError
from nvrx_core.events import EventLog
from nvrx_core.preemption import DistributedSignalHandler as CoreSignalHandler
from nvrx_core.preemption import PreemptionConfig
from nvrx_core.signals import SignalRegistry, parse_signal


class DistributedSignalHandler:
    """Records `sig` on this rank while entered; `signals_received()` tells every rank who got it.

    Megatron's constructor takes `sig` only; the keyword-only arguments are not Megatron's:
    `process_group` (default: the default group, or a world of one without
    torch.distributed), `events` (the suite's event log) and `signals` (a SignalRegistry;
    default: this process's).
    """

    def __init__(self, sig: Union[signal.Signals, int, str] = signal.SIGTERM, *,
                 process_group: Any = None, events: Optional[EventLog] = None,
                 signals: Optional[SignalRegistry] = None):
        self.sig = parse_signal(sig, "sig")  # Megatron's Signals member, or a number or a name
        try:
            self._config = PreemptionConfig(signals=[self.sig.name])
        except ConfigError as e:  # e.g. SIGKILL: reworded with this class's argument name
            raise ValueError(f"sig={self.sig.name}: {str(e).split(': ', 1)[-1]}") from None
        self._options = dict(process_group=process_group, events=events, signals=signals)
        self.core = CoreSignalHandler(self._config, **self._options)
        """The nvrx_core handler (should_stop(step), exit_preempted(), received)."""
        self.released = True
        """False while entered (the signal is claimed)."""

    @property
    def signaled(self) -> bool:
        """Whether this rank received `sig` since it entered (no collective)."""
        return self.core.signaled

    def signals_received(self, step: Optional[int] = None) -> List[bool]:
        """Collective: one flag per rank of the group, in rank order; every rank must call it.
        `step` (ours, optional): the iteration it is asked at, recorded with the agreement, so
        the incident timeline says where every rank stopped."""
        return self.core.signaled_ranks(step)

    def __enter__(self) -> "DistributedSignalHandler":
        """Claim `sig` (main thread only: Python runs signal handlers there)."""
        if not self.released:
            raise RuntimeError(f"DistributedSignalHandler({self.sig.name}) is already entered; release() it first")
        if self.core.received or self.core.installed:
            self.core = CoreSignalHandler(self._config, **self._options)  # re-entry starts clean
        self.core.install()
        self.released = False
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def release(self) -> bool:
        """Give `sig` back (the previous disposition returns). True if it was held, False if
        there was nothing to release (never entered, or released already)."""
        if self.released:
            return False
        self.core.release()
        self.released = True
        return True


__all__ = ["DistributedSignalHandler"]
