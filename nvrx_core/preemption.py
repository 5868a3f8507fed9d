"""Preemption: notice the scheduler's signal on any rank, agree on it, save, exit 18.

    handler = DistributedSignalHandler(PreemptionConfig(check_every_n_steps=10)).install()
    for step in range(start, total):
        train_step()
        if handler.should_stop(step):          # one tiny all_reduce every 10 steps
            ckpt.save(state(), step); ckpt.finalize(blocking=True)
            handler.exit_preempted()           # SystemExit(ExitCode.PREEMPTED): requeue me

A scheduler may signal only some ranks (or one node first), and ranks that stop at
different steps would deadlock in the next collective, so the decision is a collective:
every rank contributes "did I get a signal" and all act on the max. Checking every step
would add a collective to every step; every N steps bounds the reaction time instead.

The handler only records the signal. A second (or third) signal while the checkpoint is
being written is recorded too and does nothing else, so it cannot interrupt the save.
"""

import dataclasses
import logging
import signal
import threading
from typing import Any, Callable, List, Mapping, Optional

from nvrx_core.collectives import Collectives, resolve_group
from nvrx_core.config import build, check, load_yaml_section
from nvrx_core.events import PREEMPTION_AGREED, EventLog
from nvrx_core.exit_codes import ExitCode, describe
from nvrx_core.signals import SignalClaim, SignalRegistry, default_registry, parse_signal

logger = logging.getLogger("nvrx.preemption")

OWNER = "preemption"
WORKER_OWNER = "preemption (DataLoader worker policy)"
WORKER_POLICIES = ("ignore", "default", "inherit")
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")
_FLAG_BYTES = len(b"false")  # the longest JSON a signaled_ranks() flag takes


def signal_names(signals: Any) -> Any:
    """An adapter's `signals` argument (one signal, or a list of them) as PreemptionConfig's
    list; PreemptionConfig reads each by the one rule (signals.parse_signal) and refuses,
    naming it, anything else."""
    if isinstance(signals, (str, int)):
        return [signals]
    return list(signals) if isinstance(signals, tuple) else signals


@dataclasses.dataclass
class PreemptionConfig:
    signals: List[str] = dataclasses.field(default_factory=lambda: ["SIGTERM"])
    """Signals that mean "you are being preempted" (Slurm: SIGTERM, or SIGUSR1 with --signal).
    Each may be given as signals.parse_signal reads it ("SIGTERM", "TERM", 15, signal.SIGTERM);
    the config keeps names ("SIGTERM")."""

    check_every_n_steps: int = 10
    """Ranks agree on a received signal every N steps (one int all_reduce)."""

    dataloader_workers: str = "ignore"
    """What DataLoader workers do with these signals (via worker_init_fn): "ignore" keeps
    them alive until the main process has saved and shuts them down; "default" lets the
    signal kill them; "inherit" keeps the parent's recording handler."""

    exit_code: int = int(ExitCode.PREEMPTED)
    """What exit_preempted() exits with (18: "preempted, requeue me"). Another number only
    where a scheduler template expects its own convention; never 0, which a scheduler reads
    as "finished, do not requeue"."""

    def __post_init__(self) -> None:
        check(isinstance(self.signals, (list, tuple)) and len(self.signals) > 0, "signals",
              self.signals, "must be a non-empty list of signal names such as SIGTERM")
        names = []
        for value in self.signals:
            names.append(parse_signal(value, "signals").name)
            check(names[-1] not in _UNCATCHABLE, "signals", value, "cannot be caught")
        self.signals = names if isinstance(self.signals, list) else tuple(names)
        check(isinstance(self.check_every_n_steps, int) and self.check_every_n_steps >= 1,
              "check_every_n_steps", self.check_every_n_steps, "must be an integer >= 1")
        check(self.dataloader_workers in WORKER_POLICIES, "dataloader_workers",
              self.dataloader_workers, f"must be one of {', '.join(WORKER_POLICIES)}")
        code = self.exit_code
        check(isinstance(code, int) and not isinstance(code, bool) and 1 <= code <= 255, "exit_code", code,
              "must be an integer in 1..255 (0 would tell the scheduler the job finished)")

    @classmethod
    def from_sources(cls, yaml_path: Optional[str] = None,
                     overrides: Mapping[str, Any] = ()) -> "PreemptionConfig":
        layers = [load_yaml_section(yaml_path, "preemption")] if yaml_path else []
        return build(cls, *layers, dict(overrides), source=yaml_path or "preemption config")

    def signal_numbers(self) -> List[signal.Signals]:
        return [parse_signal(name, "signals") for name in self.signals]


@dataclasses.dataclass
class WorkerSignalPolicy:
    """A picklable DataLoader worker_init_fn applying the configured signal policy, then
    the user's own worker_init_fn (if any)."""

    signals: List[int]
    policy: str
    then: Optional[Callable[[int], None]] = None

    def __call__(self, worker_id: int) -> None:
        if self.policy != "inherit":  # a worker process: its registry holds no claims yet
            disposition = signal.SIG_IGN if self.policy == "ignore" else signal.SIG_DFL
            for number in self.signals:
                default_registry().claim(number, WORKER_OWNER, disposition, replace=True)
        if self.then is not None:
            self.then(worker_id)


class DistributedSignalHandler:
    """Records preemption signals on the main thread; agrees on them across ranks.

    `process_group`: the ranks that agree (None: the default group, resolved when the handler
    is built; a world of one without torch.distributed; collectives.SINGLE_PROCESS: this
    process alone)."""

    def __init__(self, config: Optional[PreemptionConfig] = None, *,
                 process_group: Any = None, events: Optional[EventLog] = None,
                 signals: Optional[SignalRegistry] = None):
        self.config = config or PreemptionConfig()
        self._group = resolve_group(process_group)
        self._events = events if events is not None else EventLog.from_env("preemption")
        self._signals = signals if signals is not None else default_registry()
        self._claims: List[SignalClaim] = []
        self._installed = False
        self._agreed = False
        self.received: List[int] = []
        """Signal numbers received on this rank, in order (appended by the handler)."""

    @property
    def signaled(self) -> bool:
        """Whether this rank received a preemption signal (no collective)."""
        return bool(self.received)

    @property
    def installed(self) -> bool:
        return self._installed

    def install(self) -> "DistributedSignalHandler":
        """Claim the signals (owner "preemption") from the process's signal registry; only
        on the main thread, where Python delivers signals. A signal another part already
        holds (e.g. the in-process Wrapper's SIGUSR1) is refused with SignalClaimError."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("DistributedSignalHandler.install() must be called on the main "
                               "thread: Python runs signal handlers only there")
        if self._installed:
            raise RuntimeError("DistributedSignalHandler is already installed")
        try:
            for number in self.config.signal_numbers():
                self._claims.append(self._signals.claim(number, OWNER, self._on_signal))
        except BaseException:
            self.release_claims()
            raise
        self._installed = True
        return self

    def release(self) -> None:
        """Restore the previous handlers. Safe to call more than once."""
        if not self._installed:
            return
        self.release_claims()
        self._installed = False

    def release_claims(self) -> None:
        while self._claims:
            self._claims.pop().release()

    def __enter__(self) -> "DistributedSignalHandler":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _on_signal(self, number: int, frame: Any) -> None:
        self.received.append(number)
        if len(self.received) == 1:
            logger.warning("received %s: will checkpoint and exit at the next agreed check",
                           signal.Signals(number).name)

    def should_stop(self, step: int) -> bool:
        """True once any rank has been signaled. Collective on steps that are multiples of
        check_every_n_steps (every rank must call it with the same step numbers); other
        steps return the last agreed answer without communicating."""
        if self._agreed:
            return True
        if step % self.config.check_every_n_steps != 0:
            return False
        return self.check_now(step)

    def check_now(self, step: Optional[int] = None) -> bool:
        """Agree now (collective), e.g. at the end of an epoch or before a long eval."""
        if self._agreed:
            return True
        (agreed,) = Collectives(self._group).all_reduce_max([int(self.signaled)])
        if agreed:
            self._agree(step)
        return bool(agreed)

    def signaled_ranks(self, step: Optional[int] = None) -> List[bool]:
        """Collective: whether each rank of the group received a signal, in group rank order.

        For loops that want to know who was signaled (Megatron's signals_received()); any
        True is an agreement too, so should_stop() answers True from then on. One all_gather
        of a few bytes per rank, on the group's device (CPU for gloo)."""
        flags = [bool(f) for f in Collectives(self._group).all_gather_json(self.signaled, _FLAG_BYTES)]
        if any(flags) and not self._agreed:
            self._agree(step)
        return flags

    def _agree(self, step: Optional[int]) -> None:
        self._agreed = True
        names = [signal.Signals(n).name for n in self.received]
        self._events.emit(PREEMPTION_AGREED, step=step, signals_here=names)
        logger.warning("preemption agreed at step %s (signals on this rank: %s)", step, names)

    @property
    def worker_init_fn(self) -> WorkerSignalPolicy:
        """Pass as DataLoader(worker_init_fn=...) to apply the dataloader_workers policy."""
        return self.wrap_worker_init_fn(None)

    def wrap_worker_init_fn(self, then: Optional[Callable[[int], None]]) -> WorkerSignalPolicy:
        return WorkerSignalPolicy([int(n) for n in self.config.signal_numbers()],
                                  self.config.dataloader_workers, then)

    def exit_preempted(self) -> None:
        """Leave with config.exit_code (ExitCode.PREEMPTED, 18, by default) so the
        scheduler/launcher requeues the job."""
        code = int(self.config.exit_code)
        logger.warning("exiting with %s (%d) after preemption", describe(code), code)
        raise SystemExit(code)
