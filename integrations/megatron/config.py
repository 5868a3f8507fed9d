"""Megatron-Bridge's four resiliency configs, checked here and translated onto nvrx_core.

A Bridge `ConfigContainer` carries `ft`, `nvrx_straggler`, `inprocess_restart` and
`rerun_state_machine`. The classes below keep Bridge's field names, order, defaults,
`Literal` values and `kw_only` flags, so a config written for Bridge builds the same object
here: FaultToleranceConfig, NVRxStragglerDetectionConfig and InProcessRestartConfig by
keyword or by position, RerunStateMachineConfig by keyword only (Bridge made it kw_only when
it began deriving it from Megatron-LM's; a positional call is refused with the keyword form
it should be).

Bridge checks only NVRxStragglerDetectionConfig, in `finalize()`. Here every class is
checked in `__post_init__`, which Bridge's `ConfigContainer.validate()` calls again for the
classes without a `finalize()`; NVRxStragglerDetectionConfig keeps its `finalize()`, the
re-check after fields were changed.

The checks and conversions are `nvrx_megatron.convert`'s functions, which read any
Bridge-shaped object by field name; the hooks call those, never these methods, so Bridge's
own dataclasses work as well as these. The methods stay for code written against them.
"""

import dataclasses
import enum
from typing import Any, Literal, Optional

from nvrx_core.ft.faults import SimulatedFault
from nvrx_core.inprocess.config import InProcessConfig
from nvrx_core.rerun.config import RerunConfig
from nvrx_core.straggler.config import StragglerConfig


def _enums_to_values(config: Any) -> None:
    """An enum member given for a Literal field is kept as its value, so the object compares,
    prints and serialises as Bridge's would."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, enum.Enum):
            setattr(config, f.name, value.value)


def _convert():
    from nvrx_megatron import convert  # imports this module: bound at call time

    return convert


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
        _enums_to_values(self)
        _convert().check_fault_tolerance(self)

    def to_simulated_fault(self, seed: int = 0) -> Optional[SimulatedFault]:
        """The core's time-based fault, or None when simulate_fault is off
        (`nvrx_megatron.convert.simulated_fault`, which takes any Bridge-shaped config)."""
        return _convert().simulated_fault(self, seed)


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
        _enums_to_values(self)
        self.to_straggler_config()

    def finalize(self) -> None:
        """Check again, after fields were changed; Bridge's ConfigContainer.validate() calls this."""
        self.to_straggler_config()

    def to_straggler_config(self, **overrides: Any) -> StragglerConfig:
        """`nvrx_megatron.convert.straggler_config(self, **overrides)`."""
        return _convert().straggler_config(self, **overrides)


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

    respawn_timeout: float = 60.0
    """(nvrx-suite) Under `ft_launcher --ft-restart-policy respawn-rank`: how long the other ranks
    wait for the replacement of a dead rank before they give up and every rank restarts."""

    def __post_init__(self) -> None:
        _enums_to_values(self)
        self.to_inprocess_config()

    def to_inprocess_config(self, **overrides: Any) -> InProcessConfig:
        """`nvrx_megatron.convert.inprocess_config(self, **overrides)`."""
        return _convert().inprocess_config(self, **overrides)


@dataclasses.dataclass(kw_only=True)
class RerunStateMachineConfig:
    """Result validation: re-run a suspicious step to tell a data problem, a transient fault
    and a faulty device apart. Converts to nvrx_core.rerun.RerunConfig, whose defaults for
    these six fields are Bridge's.

    Keyword-only, as Bridge's is since it derives from Megatron-LM's keyword-only class:
    code that builds it positionally would fail on Bridge, so it fails here too, saying how.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "RerunStateMachineConfig":
        if args:  # the older, positional shape: say the keyword form instead of "takes 1 positional argument"
            names = [f.name for f in dataclasses.fields(cls)]
            written = ", ".join(f"{n}={v!r}" for n, v in zip(names, args))
            raise TypeError(f"RerunStateMachineConfig takes keyword arguments only, as Megatron-Bridge's does: "
                            f"RerunStateMachineConfig({written})")
        return super().__new__(cls)

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
        _enums_to_values(self)
        self.to_rerun_config()

    def to_rerun_config(self, **overrides: Any) -> RerunConfig:
        """`nvrx_megatron.convert.rerun_config(self, **overrides)`."""
        return _convert().rerun_config(self, **overrides)


__all__ = ["FaultToleranceConfig", "InProcessRestartConfig", "NVRxStragglerDetectionConfig",
           "RerunStateMachineConfig"]
