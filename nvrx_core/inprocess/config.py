"""In-process restart parameters, checked before any training starts.

Names and defaults follow nvidia-resiliency-ext's inprocess.Wrapper where it has the same
knob (soft_timeout 60 s, hard_timeout 90 s, heartbeat_interval 1 s, heartbeat_timeout
30 s, barrier_timeout 120 s, completion_timeout 120 s, monitor interval 1 s, termination
grace 5 s), so users moving over keep their settings. Durations are seconds; a
datetime.timedelta is accepted too.
"""

import dataclasses
import datetime
import os
from typing import Any, Mapping, Optional

from nvrx_core.config import ConfigError, build, check, load_yaml_section
from nvrx_core.signals import parse_signal

GRANULARITIES = ("rank", "node")
YAML_SECTION = "inprocess"
DURATION_FIELDS = (
    "soft_timeout", "hard_timeout", "heartbeat_interval", "heartbeat_timeout", "barrier_timeout",
    "completion_timeout", "monitor_interval", "termination_grace", "monitor_process_interval",
    "progress_watchdog_interval", "last_call_wait", "respawn_timeout",
)
OPTIONAL_DURATIONS = ("monitor_process_interval", "progress_watchdog_interval")
ZERO_ALLOWED = ("termination_grace", "last_call_wait")


@dataclasses.dataclass
class InProcessConfig:
    soft_timeout: float = 60.0
    """No progress while the GIL is free for this long: the rank is interrupted and restarts."""
    hard_timeout: float = 90.0
    """No progress at all (e.g. a C call holding the GIL): the monitor process kills the rank."""
    heartbeat_interval: float = 1.0
    """How often each rank tells the store it is alive."""
    heartbeat_timeout: float = 30.0
    """A rank (or a whole node) silent this long is declared lost."""
    barrier_timeout: float = 120.0
    """Longest wait for the other ranks at a restart barrier; then the Wrapper gives up."""
    completion_timeout: float = 120.0
    """Longest wait, after this rank finished, for every active rank to finish."""
    monitor_interval: float = 1.0
    """Period of the in-rank monitor thread (soft timeout, peer faults); <= soft_timeout."""
    termination_grace: float = 5.0
    """Hard timeout: seconds between the termination signal and SIGKILL."""
    max_iterations: Optional[int] = None
    """Calls of the function allowed, the first included (None: unlimited); then exit 22."""
    max_rank_faults: Optional[int] = None
    """A rank that caused more faults than this is excluded and exits 22."""
    active_world_size: Optional[int] = None
    """Ranks that train; the others are warm reserves (None: all train)."""
    min_active_world_size: int = 1
    """Fewer active ranks than this after a fault: every rank gives up (exit 22)."""
    granularity: str = "rank"
    """"rank": a fault excludes the rank; "node": it excludes every rank of its node."""
    empty_cuda_cache: bool = True
    """Release cached CUDA memory after an abort (only where CUDA was initialised)."""
    monitor_log_dir: Optional[str] = None
    """Directory for the monitor processes' logs (monitor_rank<N>.log); None: no file."""
    interrupt_signal: str = "SIGUSR1"
    """Signal used to interrupt the rank's main thread (it also breaks blocking sleeps)."""
    termination_signal: str = "SIGTERM"
    """Hard timeout: first signal sent to the rank, before SIGKILL."""
    stack_dump_signal: Optional[str] = "SIGUSR2"
    """Hard timeout: sent first, so faulthandler prints every thread's stack (None: no dump)."""
    enabled: bool = True
    """False: the function is called once, without any restart machinery."""
    monitor_process_interval: Optional[float] = None
    """Period of the hard-timeout monitor process: how late past hard_timeout a kill may come,
    and how soon the death of its rank is declared. None: min(monitor_interval, 0.5)."""
    progress_watchdog_interval: Optional[float] = None
    """How often the main thread's progress is sampled (and sent to the monitor process); the
    soft timeout may see a busy rank up to this much idle. None: min(monitor_interval, 0.5)."""
    last_call_wait: float = 0.0
    """After a fault, the restart plan is made no earlier than this many seconds after this rank
    left the iteration, so terminations that follow the fault closely (a node's other ranks
    dying with it) are handled by the same restart, not by one restart each. 0: at once."""
    respawn_timeout: float = 60.0
    """Under `ft_launcher --ft-restart-policy respawn-rank`, which replaces a dead rank's process
    and leaves the others running: how long the others wait for the replacement to join before
    they give up (exit 22) and the launcher restarts every rank."""

    def __post_init__(self):
        for name in DURATION_FIELDS:
            value = getattr(self, name)
            if value is None and name in OPTIONAL_DURATIONS:
                continue
            if isinstance(value, datetime.timedelta):
                value = value.total_seconds()
                setattr(self, name, value)
            check(isinstance(value, (int, float)) and not isinstance(value, bool), name, value,
                  "must be a number of seconds (or a datetime.timedelta)")
            check(value >= 0 if name in ZERO_ALLOWED else value > 0, name, value,
                  ">= 0" if name in ZERO_ALLOWED else "must be > 0")
        check(self.soft_timeout < self.hard_timeout < self.barrier_timeout, "soft_timeout/hard_timeout/barrier_timeout",
              (self.soft_timeout, self.hard_timeout, self.barrier_timeout), "need soft_timeout < hard_timeout < barrier_timeout")
        check(self.heartbeat_interval < self.heartbeat_timeout, "heartbeat_interval", self.heartbeat_interval,
              f"must be < heartbeat_timeout ({self.heartbeat_timeout})")
        check(self.heartbeat_timeout < self.barrier_timeout, "heartbeat_timeout", self.heartbeat_timeout,
              f"must be < barrier_timeout ({self.barrier_timeout})")
        check(self.monitor_interval < self.soft_timeout, "monitor_interval", self.monitor_interval,
              f"must be < soft_timeout ({self.soft_timeout})")
        check(self.monitor_interval < self.heartbeat_timeout, "monitor_interval", self.monitor_interval,
              f"must be < heartbeat_timeout ({self.heartbeat_timeout})")
        # A sampling period as long as the soft timeout would make a busy rank look idle for it.
        for name in OPTIONAL_DURATIONS:
            value = getattr(self, name)
            check(value is None or value < self.soft_timeout, name, value,
                  f"must be < soft_timeout ({self.soft_timeout})")
        check(self.monitor_process_interval is None or self.monitor_process_interval < self.heartbeat_timeout,
              "monitor_process_interval", self.monitor_process_interval,
              f"must be < heartbeat_timeout ({self.heartbeat_timeout})")
        check(self.last_call_wait < self.barrier_timeout, "last_call_wait", self.last_call_wait,
              f"must be < barrier_timeout ({self.barrier_timeout})")
        for name in ("max_iterations", "active_world_size"):
            value = getattr(self, name)
            check(value is None or _is_int(value) and value >= 1, name, value, "must be None or an integer >= 1")
        check(self.max_rank_faults is None or _is_int(self.max_rank_faults) and self.max_rank_faults >= 0,
              "max_rank_faults", self.max_rank_faults, "must be None or an integer >= 0")
        check(_is_int(self.min_active_world_size) and self.min_active_world_size >= 1, "min_active_world_size",
              self.min_active_world_size, "must be an integer >= 1")
        check(self.active_world_size is None or self.min_active_world_size <= self.active_world_size,
              "min_active_world_size", self.min_active_world_size,
              f"must be <= active_world_size ({self.active_world_size})")
        check(self.granularity in GRANULARITIES, "granularity", self.granularity, f"must be one of {GRANULARITIES}")
        check(self.monitor_log_dir is None or isinstance(self.monitor_log_dir, str) and os.path.isabs(self.monitor_log_dir),
              "monitor_log_dir", self.monitor_log_dir, "must be None or an absolute path")
        self.interrupt_signal = _signal_name("interrupt_signal", self.interrupt_signal, must_be_catchable=True)
        self.termination_signal = _signal_name("termination_signal", self.termination_signal, must_be_catchable=False)
        check(self.interrupt_signal != self.termination_signal, "interrupt_signal", self.interrupt_signal,
              "must differ from termination_signal")
        if self.stack_dump_signal is not None:
            self.stack_dump_signal = _signal_name("stack_dump_signal", self.stack_dump_signal, must_be_catchable=True)
            check(self.stack_dump_signal not in (self.interrupt_signal, self.termination_signal), "stack_dump_signal",
                  self.stack_dump_signal, "must differ from interrupt_signal and termination_signal")
        for name in ("empty_cuda_cache", "enabled"):
            check(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be true or false")

    def check_world(self, world_size: int) -> None:
        """Rules that need the world size; run at the first barrier, before training starts."""
        check(self.active_world_size is None or self.active_world_size <= world_size, "active_world_size",
              self.active_world_size, f"must be <= the world size ({world_size})")
        check(self.min_active_world_size <= world_size, "min_active_world_size", self.min_active_world_size,
              f"must be <= the world size ({world_size})")

    @classmethod
    def from_layers(cls, yaml_path: Optional[str] = None, overrides: Optional[Mapping[str, Any]] = None) -> "InProcessConfig":
        """defaults < the `inprocess:` section of `yaml_path` < `overrides`."""
        layers = [load_yaml_section(yaml_path, YAML_SECTION)] if yaml_path else []
        return build(cls, *layers, overrides or {}, source=yaml_path or "InProcessConfig")

    @property
    def store_request_timeout(self) -> float:
        """Longest wait of the watchdogs (monitor thread, monitor process) for one store answer.

        A quarter of soft_timeout, within [0.5, 5] s: a store that stops answering delays
        the soft timeout by about this much, and a request slower than this (a loaded store)
        only skips one monitor tick.
        """
        return min(5.0, max(0.5, self.soft_timeout / 4))

    @property
    def monitor_process_period(self) -> float:
        """The monitor process's period in effect (monitor_process_interval or its default)."""
        return self.monitor_process_interval or min(self.monitor_interval, 0.5)

    @property
    def progress_period(self) -> float:
        """The progress sampling period in effect (progress_watchdog_interval or its default)."""
        return self.progress_watchdog_interval or min(self.monitor_interval, 0.5)

    def signal_number(self, name: str) -> Optional[int]:
        value = getattr(self, name)
        return None if value is None else int(parse_signal(value, name))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _signal_name(field: str, value, must_be_catchable: bool) -> str:
    """`value` read by the one signal rule (signals.parse_signal: "SIGUSR1", "USR1", "usr1", 10 or
    signal.SIGUSR1), kept as its name ("SIGUSR1"), as this config always stored it."""
    name = parse_signal(value, field).name
    check(name != "SIGSTOP", field, value, "does not end a process")
    check(not must_be_catchable or name != "SIGKILL", field, value, "cannot be caught; choose another signal")
    return name


__all__ = ["ConfigError", "InProcessConfig"]
