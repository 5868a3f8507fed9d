"""A stop signal from outside: the scheduler asks the job to stop, and the workers may save first.

Slurm's preemption or time-limit warning (`sbatch --signal=TERM@60`) sends SIGTERM to every
process of the job step at once: ft_launcher, its node monitor and fork server, every worker.
torch's agent turns the signals it handles (torchrun's --signals-to-handle) into an exception,
forwards the signal to the workers still running and SIGKILLs what is left after a grace
(--workers-stop-timeout here). A worker with a preemption handler (nvrx_core.preemption)
saves and exits PREEMPTED, and the launcher then ends PREEMPTED too: the job was preempted,
not failed, so the scheduler requeues it ($NVRX_PREEMPTED_EXIT_CODE maps it where a template
wants another code). Workers that did not handle it keep torchrun's answer: 128 + the signal.

The helpers the launcher needs meanwhile ignore such signals (signals.ignore_stop_requests):
the node monitor keeps the saving ranks' timeouts, the fork server reports their exits.
"""

import dataclasses
import logging
import os
import signal
from typing import Dict, List, Optional

from nvrx_core.exit_codes import ExitCode
from nvrx_core.signals import SignalClaim, default_registry

logger = logging.getLogger("nvrx.ft.launcher")

SIGNALS_TO_HANDLE_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
TORCH_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""What torch's agent handles when the variable is unset (torchrun's --signals-to-handle default)."""
OWNER = "ft_launcher (stopping on a signal)"


def handled_signals(environ=os.environ) -> List[signal.Signals]:
    """The signals torch's agent turns into a stop (SignalException) in this launcher."""
    names = environ.get(SIGNALS_TO_HANDLE_ENV) or TORCH_DEFAULT_SIGNALS
    found = [getattr(signal, name.strip(), None) for name in names.split(",")]
    return [s for s in found if isinstance(s, signal.Signals)]


def preempted(exit_codes: Dict[int, Optional[int]]) -> bool:
    """Whether the workers' exits after a stop signal show a preemption: at least one exited
    PREEMPTED, and every worker that exited on its own did. A worker killed by a signal (the
    forwarded one, the SIGKILL after the grace) does not count either way: the scheduler is
    taking the job, and a rank that saved says the checkpoint was agreed on."""
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


def hold_repeats(signals: List[signal.Signals], grace: float) -> List[SignalClaim]:
    """While the workers stop, a repeated signal (Slurm may signal again, a user may press ^C
    twice) must not cut the bounded grace short: torch's handler would raise out of its wait
    and leave the workers running. Each is logged instead; release the claims when the
    launcher ends."""

    def repeated(number: int, _frame) -> None:
        logger.warning("received %s again: the workers are being stopped already (at most %.0f s, then SIGKILL)",
                       signal.Signals(number).name, grace)

    registry = default_registry()
    claims: List[SignalClaim] = []
    try:
        for number in signals:
            claims.append(registry.claim(number, OWNER, repeated))
    except BaseException:
        for held in reversed(claims):
            held.release()
        raise
    return claims
