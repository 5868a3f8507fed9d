"""Megatron-Bridge's four resiliency configs, checked here and translated onto nvrx_core.

A Bridge `ConfigContainer` carries `ft`, `nvrx_straggler`, `inprocess_restart` and
`rerun_state_machine`. The classes below keep Bridge's field names, order, defaults,
`Literal` values and `kw_only` flags (none of the four is kw_only in Bridge), so a config
written for Bridge, by keyword or by position, builds the same object here.

Bridge checks only NVRxStragglerDetectionConfig, in `finalize()`. Here every class is
checked in `__post_init__`, which Bridge's `ConfigContainer.validate()` calls again for the
classes without a `finalize()`; NVRxStragglerDetectionConfig keeps its `finalize()`, the
re-check after fields were changed. The rules the core config enforces are not written
twice: each check builds the core config and rewords its error with Bridge's field names,
so every error reads "<Class>: <bridge field>=<value>: <rule>".

Each class converts to what nvrx_core runs on; the values Bridge sets (its defaults
included) are passed explicitly wherever the core's own defaults differ, and `**overrides`
(core field names) reach the core knobs Bridge has no field for.
"""

import contextlib
import dataclasses
import enum
import math
import os
import re
import typing
from typing import Any, Iterator, Literal, Mapping, Optional

from nvrx_core.config import ConfigError, build, check
from nvrx_core.ft.faults import SimulatedFault
from nvrx_core.inprocess.config import InProcessConfig
from nvrx_core.rerun.config import RerunConfig
from nvrx_core.straggler.config import MEGATRON_FIELDS, StragglerConfig

# Core field name -> Bridge field name, for rewording the core's errors.
_FAULT_NAMES = {"fault_type": "simulated_fault_type", "rank_to_fail": "simulated_fault_rank",
                "base_delay": "simulated_fault_base_delay"}
_STRAGGLER_NAMES = {core: bridge for bridge, core in MEGATRON_FIELDS.items()}
_INPROCESS_NAMES = {"monitor_interval": "monitor_thread_interval", "termination_grace": "termination_grace_time",
                    "monitor_log_dir": "monitor_process_logdir"}

SIMULATED_FAULT_JITTER = 0.2
"""Bridge delays a simulated fault by base_delay plus up to this fraction of it, at random."""


def _reworded(message: str, names: Mapping[str, str]) -> str:
    renames = {core: bridge for core, bridge in names.items() if core != bridge}
    if not renames:
        return message
    pattern = r"\b(" + "|".join(map(re.escape, renames)) + r")\b"
    return re.sub(pattern, lambda m: renames[m.group(1)], message)


@contextlib.contextmanager
def _errors_named(config: Any, names: Optional[Mapping[str, str]] = None) -> Iterator[None]:
    """Prefix any ConfigError with the class name and put Bridge's field names in it."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError(f"{type(config).__name__}: {_reworded(str(e), names or {})}") from None


def _check_literals(config: Any) -> None:
    """Every Literal-annotated field holds one of its values (an enum member counts as its value)."""
    for name, hint in typing.get_type_hints(type(config)).items():
        if typing.get_origin(hint) is not Literal:
            continue
        value = getattr(config, name)
        if isinstance(value, enum.Enum):
            value = value.value
            setattr(config, name, value)
        allowed = typing.get_args(hint)
        check(value in allowed, name, value, f"must be one of {', '.join(map(repr, allowed))}")


def _check_bool(config: Any, *names: str) -> None:
    for name in names:
        check(isinstance(getattr(config, name), bool), name, getattr(config, name), "must be True or False")


def _check_seconds(config: Any, name: str, allow_zero: bool) -> None:
    value = getattr(config, name)
    valid = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    valid = valid and (value >= 0 if allow_zero else value > 0)
    check(valid, name, value, "must be a finite number of seconds " + (">= 0" if allow_zero else "> 0"))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass
class FaultToleranceConfig:
    """Rank-side fault tolerance: sections and heartbeats sent to the ft_launcher's monitor.

    The timeouts are not here, as in Bridge: the monitor enforces them for every rank of a
    node, so they are the launcher's settings (ft_launcher's --ft-* flags or its YAML,
    nvrx_core.ft.config.FTConfig). The only core object this config produces is the
    simulated fault (`to_simulated_fault`).
    """

    enable_ft_package: bool = False
    """Connect to the monitor and report sections; False makes every fault-tolerance hook a no-op."""

    calc_ft_timeouts: bool = False
    """Replace the launcher's section timeouts by ones measured on this job (safety factor x the
    longest time seen), saved so the next restart starts with them."""

    simulate_fault: bool = False
    """Arm one simulated fault, to rehearse a recovery before a real one; testing only."""

    simulated_fault_type: Literal["rank_hung", "rank_killed", "random"] = "random"
    """rank_hung stops the process (SIGSTOP), rank_killed kills it (SIGKILL), random picks one
    of the two, the same on every rank."""

    simulated_fault_rank: Optional[int] = None
    """Global rank that fails; None: one chosen at random, the same on every rank."""

    simulated_fault_base_delay: int = 0
    """Seconds from arming to the fault; up to 20% more is added at random, as in Bridge."""

    def __post_init__(self) -> None:
        self._fault(seed=0)

    def to_simulated_fault(self, seed: int = 0) -> Optional[SimulatedFault]:
        """The core's time-based fault, or None when simulate_fault is off.

        `seed` picks the random rank and kind; every rank passes the same one, so all agree
        without the broadcast Bridge needs (which would fail on a CPU / gloo job).
        """
        fault = self._fault(seed)
        return fault if self.simulate_fault else None

    def _fault(self, seed: int) -> SimulatedFault:
        with _errors_named(self, _FAULT_NAMES):
            _check_literals(self)
            _check_bool(self, "enable_ft_package", "calc_ft_timeouts", "simulate_fault")
            rank = self.simulated_fault_rank
            check(rank is None or _is_int(rank) and rank >= 0, "simulated_fault_rank", rank,
                  "must be None or a global rank (an integer >= 0)")
            _check_seconds(self, "simulated_fault_base_delay", allow_zero=True)
            delay = float(self.simulated_fault_base_delay)
            return SimulatedFault(fault_type=self.simulated_fault_type, rank_to_fail=rank, base_delay=delay,
                                  jitter=SIMULATED_FAULT_JITTER * delay, seed=seed)


@dataclasses.dataclass
class NVRxStragglerDetectionConfig:
    """Straggler detection: score every rank's step time and name the ones everyone waits for.

    Converts to nvrx_core.straggler.StragglerConfig. One difference in behaviour: the core
    flags a rank only after its score was bad in `consecutive_reports` (2) reports in a row,
    where Bridge acts on one; pass consecutive_reports=1 to `to_straggler_config` for that.
    """

    enabled: bool = False
    """Time the training step on every rank and produce periodic reports."""

    report_time_interval: float = 300.0
    """Seconds between two reports; each report costs a gather of every rank's timings."""

    calc_relative_gpu_perf: bool = True
    """Score each rank against the fastest one (finds a slow device among healthy ones)."""

    calc_individual_gpu_perf: bool = True
    """Score each rank against its own earlier steps (finds a device that got slower)."""

    num_gpu_perf_scores_to_print: int = 5
    """Best and worst ranks listed in each report; 0 lists them only when a straggler is found."""

    gpu_relative_perf_threshold: float = 0.7
    """A relative score below this flags the rank (0.7: about 43% slower than the fastest).
    Must be in (0, 1]; Bridge also takes 0, which can never flag: turn the score off instead."""

    gpu_individual_perf_threshold: float = 0.7
    """An individual score below this flags the rank (0.7: about 43% slower than its own baseline).
    Must be in (0, 1], as above."""

    stop_if_detected: bool = False
    """On a straggler, every rank checkpoints and exits (exit code 19), so the job can be
    restarted without the slow node instead of running slowly to the end."""

    enable_logging: bool = True
    """Log each report's score summary (the events are written either way)."""

    profiling_interval: int = 1
    """Time only every N-th step (1: every step); larger values cost less on very short steps."""

    logger_name: str = "megatron.bridge.NVRxStragglerDetection"
    """Logger the reports go to, Bridge's name by default so existing log filters keep working."""

    def __post_init__(self) -> None:
        self.to_straggler_config()

    def finalize(self) -> None:
        """Check again, after fields were changed; Bridge's ConfigContainer.validate() calls this."""
        self.to_straggler_config()

    def to_straggler_config(self, **overrides: Any) -> StragglerConfig:
        """The core's StragglerConfig with every Bridge value (core defaults differ: 60 s, 0.8,
        enabled); gather_on_rank0=True as Bridge's detector runs; `overrides` use core names."""
        with _errors_named(self, _STRAGGLER_NAMES):
            values = {bridge: getattr(self, bridge) for bridge in MEGATRON_FIELDS}
            return StragglerConfig.from_megatron(values, **{"gather_on_rank0": True, **overrides})


@dataclasses.dataclass
class InProcessRestartConfig:
    """In-process restart: after a fault, re-run the training function in the same processes.

    Converts to nvrx_core.inprocess.InProcessConfig, every field included (the core took
    monitor_process_interval, progress_watchdog_interval and last_call_wait under the same
    names), so a rule linking fields (an interval below soft_timeout) fails here, where the
    config is built.
    """

    enabled: bool = False
    """Wrap the training function; False runs it once, with no restart machinery."""

    max_iterations: Optional[int] = None
    """Calls of the training function allowed, the first included; then the job gives up
    (exit 22) instead of restarting forever. None: no limit. Bridge declares it but never uses it."""

    monitor_thread_interval: float = 1.0
    """Seconds between two checks of the in-rank monitor thread (soft timeout, peers' faults);
    the delay before a rank notices a fault elsewhere."""

    monitor_process_interval: float = 1.0
    """Seconds between two checks of the per-rank monitor process (hard timeout); checked only."""

    progress_watchdog_interval: float = 1.0
    """Seconds between two automatic progress stamps of the rank; checked only."""

    heartbeat_interval: float = 30.0
    """Seconds between two heartbeats a rank writes to the coordination store."""

    soft_timeout: float = 60.0
    """Seconds without progress after which the rank is interrupted and the job restarts in-process."""

    hard_timeout: float = 90.0
    """Seconds without progress after which the rank is terminated (it did not answer the
    interrupt, e.g. stuck in a call holding the GIL). Must exceed soft_timeout."""

    heartbeat_timeout: float = 60.0
    """Seconds of heartbeat silence after which a rank is declared lost."""

    barrier_timeout: float = 120.0
    """Longest wait, in seconds, for the other ranks at a restart barrier; then this rank gives up."""

    completion_timeout: float = 120.0
    """Longest wait, in seconds, after this rank finished, for every active rank to finish."""

    last_call_wait: float = 1.0
    """Seconds Bridge's peer waits for other ranks' concurrent faults before restarting; checked only."""

    termination_grace_time: float = 1.0
    """Seconds between the termination signal and SIGKILL on a hard timeout (the core's default is 5)."""

    granularity: Literal["node", "rank"] = "node"
    """What a fault takes out of the job: the failing rank alone, or its whole node (a node's
    ranks share devices and links, so one fault often means the node is bad)."""

    active_world_size: Optional[int] = None
    """Ranks that train at first; the others wait as warm reserves. None: every rank trains."""

    empty_cuda_cache: bool = True
    """Release cached CUDA memory after an abort, so the next attempt has the memory it had."""

    max_rank_faults: Optional[int] = None
    """A rank that caused more faults than this leaves the job. None: no limit."""

    monitor_process_logdir: Optional[str] = None
    """Directory for the monitor processes' logs (one file per rank); a relative path is taken
    from the current directory. None: no log file."""

    def __post_init__(self) -> None:
        self.to_inprocess_config()

    def to_inprocess_config(self, **overrides: Any) -> InProcessConfig:
        """The core's InProcessConfig with every Bridge value; Bridge's defaults differ from the
        core's in granularity, heartbeat_interval, heartbeat_timeout and the termination grace.
        `overrides` use core names (e.g. interrupt_signal)."""
        with _errors_named(self, _INPROCESS_NAMES):
            _check_literals(self)
            for name in ("monitor_process_interval", "progress_watchdog_interval"):
                _check_seconds(self, name, allow_zero=False)
            _check_seconds(self, "last_call_wait", allow_zero=True)
            logdir = self.monitor_process_logdir
            check(logdir is None or isinstance(logdir, str) and logdir.strip() != "", "monitor_process_logdir",
                  logdir, "must be None or a directory path")
            values = {
                "enabled": self.enabled, "max_iterations": self.max_iterations,
                "monitor_interval": self.monitor_thread_interval, "heartbeat_interval": self.heartbeat_interval,
                "soft_timeout": self.soft_timeout, "hard_timeout": self.hard_timeout,
                "heartbeat_timeout": self.heartbeat_timeout, "barrier_timeout": self.barrier_timeout,
                "completion_timeout": self.completion_timeout, "termination_grace": self.termination_grace_time,
                "granularity": self.granularity, "active_world_size": self.active_world_size,
                "empty_cuda_cache": self.empty_cuda_cache, "max_rank_faults": self.max_rank_faults,
                "monitor_log_dir": None if logdir is None else os.path.abspath(logdir),
                "monitor_process_interval": self.monitor_process_interval,
                "progress_watchdog_interval": self.progress_watchdog_interval,
                "last_call_wait": self.last_call_wait,
            }
            return build(InProcessConfig, values, overrides, source="overrides")


@dataclasses.dataclass
class RerunStateMachineConfig:
    """Result validation: re-run a suspicious step to tell a data problem, a transient fault
    and a faulty device apart. Converts to nvrx_core.rerun.RerunConfig, whose defaults for
    these six fields are Bridge's."""

    error_injection_rate: int = 0
    """Inject a suspicious result once every N validations on average, to test the machinery;
    0 injects none."""

    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = "transient_error"
    """What an injected result turns out to be on re-run: correct after all, a one-off fault, or
    a fault that follows the device."""

    rerun_mode: Literal["disabled", "validate_results", "report_determinism_stats"] = "disabled"
    """disabled: a rejected result is only reported; validate_results: it is re-run to find
    the cause; report_determinism_stats: every step runs twice and the differences are reported."""

    check_for_nan_in_loss: bool = True
    """Reject a NaN or infinite loss (a wasted step at best, a corrupt model at worst)."""

    check_for_spiky_loss: bool = False
    """Reject a loss far above its recent values (spiky_loss_factor); off by default, as a real
    spike is not always a fault."""

    spiky_loss_factor: float = 10.0
    """How many times the recent loss a loss must exceed to count as spiky; must be > 1."""

    def __post_init__(self) -> None:
        self.to_rerun_config()

    def to_rerun_config(self, **overrides: Any) -> RerunConfig:
        """The core's RerunConfig with these six values; `overrides` reach the core-only knobs
        (result_rejected_tracker_filename, spiky_loss_window, ...)."""
        with _errors_named(self):
            _check_literals(self)
            values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            return build(RerunConfig, values, overrides, source="overrides")


__all__ = ["FaultToleranceConfig", "InProcessRestartConfig", "NVRxStragglerDetectionConfig",
           "RerunStateMachineConfig"]
