"""A stop signal from outside: the scheduler asks the job to stop, and the workers may save first.

Slurm's preemption or time-limit warning (`sbatch --signal=TERM@60`) sends SIGTERM to every
process of the job step at once: ft_launcher, its node monitor and fork server, every worker.
torch's agent turns the signals it handles (torchrun's --signals-to-handle) into an exception,
forwards the signal to the workers still running and SIGKILLs what is left after a grace
(--term-timeout / --shutdown-timeout, by default --workers-stop-timeout, here). A worker with a preemption handler (nvrx_core.preemption)
saves and exits PREEMPTED, and the launcher then ends PREEMPTED too: the job was preempted,
not failed, so the scheduler requeues it ($NVRX_PREEMPTED_EXIT_CODE maps it where a template
wants another code). Workers that did not handle it keep torchrun's answer: 128 + the signal.

The helpers the launcher needs meanwhile ignore such signals (signals.ignore_stop_requests):
the node monitor keeps the saving ranks' timeouts, the fork server reports their exits.
A launcher without workers (a hot spare) has nothing to save and ends PREEMPTED as well.
"""

import dataclasses
import logging
import os
import signal
from typing import Dict, List, Optional

from torch.distributed.elastic.multiprocessing.api import SignalException

from nvrx_core.config import ConfigError
from nvrx_core.exit_codes import ExitCode
from nvrx_core.signals import SignalClaim, default_registry, parse_signal

logger = logging.getLogger("nvrx.ft.launcher")

SIGNALS_TO_HANDLE_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
TORCH_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""What torch's agent handles when the variable is unset (torchrun's --signals-to-handle default)."""
OWNER = "ft_launcher (stop signals)"


def handled_signals(environ=os.environ) -> List[signal.Signals]:
    """The signals torch's agent turns into a stop (SignalException) in this launcher, each read
    by the suite's one rule (signals.parse_signal). A name that is no signal is skipped with a
    warning, as torch's agent skips it."""
    names = environ.get(SIGNALS_TO_HANDLE_ENV) or TORCH_DEFAULT_SIGNALS
    found: List[signal.Signals] = []
    for name in filter(str.strip, names.split(",")):
        try:
            sig = parse_signal(name, SIGNALS_TO_HANDLE_ENV)
        except ConfigError as e:
            logger.warning("%s; not handled", e)
            continue
        if sig not in found:
            found.append(sig)
    return found


def preempted(exit_codes: Dict[int, Optional[int]]) -> bool:
    """Whether the workers' exits after a stop signal show a preemption: at least one exited
    PREEMPTED, and every worker that exited on its own did. A worker killed by a signal (the
    forwarded one, the SIGKILL after the grace) does not count either way: the scheduler is
    taking the job, and a rank that saved says the checkpoint was agreed on. A launcher that
    never started a worker (no exits at all: a hot spare waiting for a slot, a node still in its
    first rendezvous) had nothing to save: preempted too, so it does not fail the job step."""
    if not exit_codes:
        return True
    own = [code for code in exit_codes.values() if code is not None and code >= 0]
    return bool(own) and all(code == ExitCode.PREEMPTED for code in own)


@dataclasses.dataclass
class SignalStop:
    """One stop signal the launcher received, and what became of its workers."""

    signal: signal.Signals
    running_ranks: List[int]
    """Global ranks still running when it came: the forwarded signal went to these."""
    exit_codes: Optional[Dict[int, Optional[int]]] = None
    """{global rank: exit code} once the workers were stopped (-N: killed by signal N)."""

    @property
    def preempted(self) -> bool:
        return self.exit_codes is not None and preempted(self.exit_codes)

    def exit_code(self) -> int:
        """ExitCode.PREEMPTED when the workers saved, else torchrun's 128 + signal."""
        return int(ExitCode.PREEMPTED) if self.preempted else 128 + int(self.signal)


class StopSignals:
    """The launcher's claim on the stop signals, from before its first rendezvous to its end.

    torch's agent installs its handler (raise SignalException) only when it starts workers.
    Before that (a hot spare waiting for a slot, a node still in its first rendezvous) a stop
    signal took its default action and killed the launcher, and Slurm recorded the step as
    failed although that node had nothing to save. Armed, the same signals raise the same
    exception from the start. Once one arrived, hold() makes a repeat (Slurm may signal again,
    a user may press ^C twice) only log: torch's handler would raise out of the bounded wait
    for the workers and leave them running."""

    def __init__(self, signals: List[signal.Signals]):
        self.signals = list(signals)
        self.grace: Optional[float] = None
        """Set by hold(): the workers are being stopped within this many seconds."""
        self.settled = False
        """Set by settle(): the run is over; a signal changes nothing."""
        self._claims: List[SignalClaim] = []

    def arm(self) -> None:
        """Claim the signals (main thread): each raises SignalException, as torch's handler does."""
        registry = default_registry()
        try:
            for number in self.signals:
                self._claims.append(registry.claim(number, OWNER, self._on_signal))
        except BaseException:
            self.release()
            raise

    def hold(self, grace: float) -> None:
        """From now on a repeat only logs. torch's agent put its own handler in place when it
        started workers: the claims are renewed, so ours runs again."""
        self.grace = grace
        registry = default_registry()
        self._claims = [registry.claim(c.signum, OWNER, self._on_signal, replace=True) for c in self._claims]

    def settle(self) -> None:
        """The run is over and the exit code decided: from now on a stop signal only logs (Slurm's
        warning can land while the launcher tears down after training finished; torch's handler,
        still in place, would raise out of the teardown and the step would fail)."""
        self.settled = True
        registry = default_registry()
        self._claims = [registry.claim(c.signum, OWNER, self._on_signal, replace=True) for c in self._claims]

    def release(self) -> None:
        """Give the signals back (the dispositions from before arm() return)."""
        while self._claims:
            self._claims.pop().release()

    def _on_signal(self, number: int, _frame) -> None:
        sig = signal.Signals(number)
        if self.settled:
            logger.warning("received %s after the run ended: the exit code stands", sig.name)
            return
        if self.grace is None:
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
        logger.warning("received %s again: the workers are being stopped already (at most %.0f s, then SIGKILL)",
                       sig.name, self.grace)
