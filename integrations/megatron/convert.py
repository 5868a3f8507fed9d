"""Any Bridge-shaped config -> the core's configs, read by field name.

A Megatron-Bridge user's `cfg.ft`, `cfg.nvrx_straggler`, `cfg.inprocess_restart` and
`cfg.rerun_state_machine` may be Bridge's own dataclasses, this package's, a subclass, a
`types.SimpleNamespace`, an omegaconf node or a plain mapping. The hooks therefore never call a
method of the config nor copy it: these functions read Bridge's field names (a field the object
lacks takes Bridge's default, as a config from an older Bridge would) and build the core's
config. The user's object is never changed.

Errors read "<Bridge class>: <field>=<value>: <rule>". Where Bridge itself has a message for a
rule, its wording is the rule ("report_time_interval must be positive", "Unknown fault type
..."); the core's own rules are reworded with Bridge's field names.
"""

import contextlib
import dataclasses
import enum
import math
import os
import re
import typing
from typing import Any, Dict, Iterator, Literal, Mapping, Optional

from nvrx_core.config import ConfigError, build, check
from nvrx_core.ft.faults import SimulatedFault
from nvrx_core.inprocess.config import InProcessConfig
from nvrx_core.rerun.config import RerunConfig
from nvrx_core.straggler.config import StragglerConfig

SIMULATED_FAULT_JITTER = 0.2
"""Bridge delays a simulated fault by base_delay plus up to this fraction of it, at random."""

# Core field name -> Bridge field name, for rewording the core's errors.
_FAULT_NAMES = {"fault_type": "simulated_fault_type", "rank_to_fail": "simulated_fault_rank",
                "base_delay": "simulated_fault_base_delay"}
_STRAGGLER_RENAMED = {"calc_relative_gpu_perf": "calc_relative_perf", "calc_individual_gpu_perf": "calc_individual_perf",
                      "num_gpu_perf_scores_to_print": "num_scores_to_print",
                      "gpu_relative_perf_threshold": "relative_perf_threshold",
                      "gpu_individual_perf_threshold": "individual_perf_threshold"}
"""Bridge's NVRxStragglerDetectionConfig fields named otherwise in StragglerConfig (the rest
share their names)."""
_STRAGGLER_NAMES = {core: bridge for bridge, core in _STRAGGLER_RENAMED.items()}
_INPROCESS_NAMES = {"monitor_interval": "monitor_thread_interval", "termination_grace": "termination_grace_time",
                    "monitor_log_dir": "monitor_process_logdir"}
_OLD_RERUN_MODES = {"report_stats": "report_determinism_stats"}
"""Megatron-LM's (and Bridge's before it narrowed the Literal) spelling -> Bridge's current value."""


def _bridge_class(name: str) -> type:
    from nvrx_megatron import config  # the dataclasses carry Bridge's fields and defaults

    return getattr(config, name)


def bridge_fields(config: Any, class_name: str) -> Dict[str, Any]:
    """Bridge's fields of `class_name` as `config` holds them; Bridge's default for a missing one.

    An object holding none of the fields is refused: it is almost always the wrong object (the
    whole ConfigContainer, a manager), and taking every default would silently turn the
    feature off. An enum member counts as its value.
    """
    cls = _bridge_class(class_name)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    if isinstance(config, Mapping):
        unknown = sorted(set(config) - set(defaults))
        if unknown:
            raise ConfigError(f"{class_name}: unknown field(s) {', '.join(map(str, unknown))}; "
                              f"known fields: {', '.join(defaults)}")
        values = {name: config.get(name, default) for name, default in defaults.items()}
    else:
        if config is None or not any(hasattr(config, name) for name in defaults):
            raise TypeError(f"{class_name}: expected an object with {class_name}'s fields "
                            f"({', '.join(list(defaults)[:3])}, ...), got {type(config).__name__}")
        values = {name: getattr(config, name, default) for name, default in defaults.items()}
    return {name: v.value if isinstance(v, enum.Enum) else v for name, v in values.items()}


def bridge_field(config: Any, class_name: str, name: str) -> Any:
    """One field, read as bridge_fields reads it, without checking the rest: for a value a hook
    reads on every step (the object was checked when the hook's owner was built)."""
    default = _bridge_class(class_name).__dataclass_fields__[name].default
    value = config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)
    return value.value if isinstance(value, enum.Enum) else value


# ---- shared checks ---------------------------------------------------------------------------

def _reworded(message: str, names: Mapping[str, str]) -> str:
    renames = {core: bridge for core, bridge in names.items() if core != bridge}
    if not renames:
        return message
    pattern = r"\b(" + "|".join(map(re.escape, renames)) + r")\b"
    return re.sub(pattern, lambda m: renames[m.group(1)], message)


@contextlib.contextmanager
def _errors_named(class_name: str, names: Optional[Mapping[str, str]] = None) -> Iterator[None]:
    """Prefix any ConfigError with the Bridge class and put Bridge's field names in it."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError(f"{class_name}: {_reworded(str(e), names or {})}") from None


def _check_literals(values: Mapping[str, Any], class_name: str) -> None:
    for name, hint in typing.get_type_hints(_bridge_class(class_name)).items():
        if typing.get_origin(hint) is Literal:
            allowed = typing.get_args(hint)
            check(values[name] in allowed, name, values[name], f"must be one of {', '.join(map(repr, allowed))}")


def _check_bool(values: Mapping[str, Any], *names: str) -> None:
    for name in names:
        check(isinstance(values[name], bool), name, values[name], "must be True or False")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_seconds(values: Mapping[str, Any], name: str, allow_zero: bool) -> None:
    value = values[name]
    valid = _is_number(value) and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    check(valid, name, value, "must be a finite number of seconds " + (">= 0" if allow_zero else "> 0"))


# ---- FaultToleranceConfig --------------------------------------------------------------------

def check_fault_tolerance(config: Any, seed: int = 0) -> SimulatedFault:
    """Every rule of FaultToleranceConfig; the fault it describes, armed or not."""
    values = bridge_fields(config, "FaultToleranceConfig")
    with _errors_named("FaultToleranceConfig", _FAULT_NAMES):
        _check_bool(values, "enable_ft_package", "calc_ft_timeouts", "simulate_fault")
        kind = values["simulated_fault_type"]
        # Bridge's hook raises this (without "random", which it has resolved by then).
        check(kind in ("rank_killed", "rank_hung", "random"), "simulated_fault_type", kind,
              f"Unknown fault type {kind} expected one of: rank_killed, rank_hung, random")
        rank = values["simulated_fault_rank"]
        check(rank is None or isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0,
              "simulated_fault_rank", rank, "must be None or a global rank (an integer >= 0)")
        _check_seconds(values, "simulated_fault_base_delay", allow_zero=True)
        delay = float(values["simulated_fault_base_delay"])
        return SimulatedFault(fault_type=kind, rank_to_fail=rank, base_delay=delay,
                              jitter=SIMULATED_FAULT_JITTER * delay, seed=seed)


def simulated_fault(config: Any, seed: int = 0) -> Optional[SimulatedFault]:
    """The core's time-based fault, or None when simulate_fault is off (or there is no config).

    Off, nothing else is read, as Bridge's hook reads nothing else. `seed` picks the random
    rank and kind; every rank passes the same one, so all agree without a collective.
    """
    if config is None:
        return None
    switch = bridge_fields(config, "FaultToleranceConfig")["simulate_fault"]
    with _errors_named("FaultToleranceConfig"):
        check(isinstance(switch, bool), "simulate_fault", switch, "must be True or False")
    return check_fault_tolerance(config, seed) if switch else None


# ---- NVRxStragglerDetectionConfig ------------------------------------------------------------

def straggler_config(config: Any, **overrides: Any) -> StragglerConfig:
    """The core's StragglerConfig with every Bridge value (the core's defaults differ: 60 s,
    0.8, enabled); gather_on_rank0=True as Bridge's detector runs; `overrides` use core names.

    Bridge's finalize() rules come first, in its words; they apply here even while detection
    is off, so switching it on later cannot fail.
    """
    values = bridge_fields(config, "NVRxStragglerDetectionConfig")
    with _errors_named("NVRxStragglerDetectionConfig", _STRAGGLER_NAMES):
        relative, individual = values["calc_relative_gpu_perf"], values["calc_individual_gpu_perf"]
        if relative is False and individual is False:
            raise ConfigError("calc_relative_gpu_perf=False, calc_individual_gpu_perf=False: At least one of "
                              "calc_relative_gpu_perf or calc_individual_gpu_perf must be True when NVRx straggler "
                              "detection is enabled (checked while it is off too)")
        interval = values["report_time_interval"]
        check(not (_is_number(interval) and interval <= 0), "report_time_interval", interval,
              "report_time_interval must be positive")
        for name, score in (("gpu_relative_perf_threshold", "calc_relative_gpu_perf"),
                            ("gpu_individual_perf_threshold", "calc_individual_gpu_perf")):
            value = values[name]
            if _is_number(value):
                check(0.0 <= value <= 1.0, name, value, f"{name} must be between 0.0 and 1.0")
                check(value != 0, name, value, f"must be in (0, 1]: 0.0 never flags a rank (Bridge accepts it; "
                                               f"turn the score off with {score}=False instead)")
        core = {_STRAGGLER_RENAMED.get(name, name): value for name, value in values.items()}
        return build(StragglerConfig, core, {"gather_on_rank0": True, **overrides},
                     source="NVRxStragglerDetectionConfig")


# ---- InProcessRestartConfig ------------------------------------------------------------------

def inprocess_config(config: Any, **overrides: Any) -> InProcessConfig:
    """The core's InProcessConfig with every Bridge value; Bridge's defaults differ from the
    core's in granularity, heartbeat_interval, heartbeat_timeout and the termination grace.
    `overrides` use core names (e.g. interrupt_signal, enabled)."""
    values = bridge_fields(config, "InProcessRestartConfig")
    with _errors_named("InProcessRestartConfig", _INPROCESS_NAMES):
        _check_literals(values, "InProcessRestartConfig")
        for name in ("monitor_process_interval", "progress_watchdog_interval"):
            _check_seconds(values, name, allow_zero=False)
        _check_seconds(values, "last_call_wait", allow_zero=True)
        logdir = values["monitor_process_logdir"]
        check(logdir is None or isinstance(logdir, str) and logdir.strip() != "", "monitor_process_logdir",
              logdir, "must be None or a directory path")
        core = {
            "enabled": values["enabled"], "max_iterations": values["max_iterations"],
            "monitor_interval": values["monitor_thread_interval"],
            "heartbeat_interval": values["heartbeat_interval"],
            "soft_timeout": values["soft_timeout"], "hard_timeout": values["hard_timeout"],
            "heartbeat_timeout": values["heartbeat_timeout"], "barrier_timeout": values["barrier_timeout"],
            "completion_timeout": values["completion_timeout"],
            "termination_grace": values["termination_grace_time"],
            "granularity": values["granularity"], "active_world_size": values["active_world_size"],
            "empty_cuda_cache": values["empty_cuda_cache"], "max_rank_faults": values["max_rank_faults"],
            "monitor_log_dir": None if logdir is None else os.path.abspath(logdir),
            "monitor_process_interval": values["monitor_process_interval"],
            "progress_watchdog_interval": values["progress_watchdog_interval"],
            "last_call_wait": values["last_call_wait"],
            "respawn_timeout": values["respawn_timeout"],
        }
        return build(InProcessConfig, core, overrides, source="overrides")


# ---- RerunStateMachineConfig -----------------------------------------------------------------

def rerun_config(config: Any, **overrides: Any) -> RerunConfig:
    """The core's RerunConfig with Bridge's six values; `overrides` reach the core-only knobs
    (result_rejected_tracker_filename, spiky_loss_window, ...)."""
    values = bridge_fields(config, "RerunStateMachineConfig")
    with _errors_named("RerunStateMachineConfig"):
        mode = values["rerun_mode"]
        if mode in _OLD_RERUN_MODES:
            raise ConfigError(f"rerun_mode={mode!r}: Megatron-LM's name (and older Bridge's); Bridge's "
                              f"RerunStateMachineConfig now calls this mode {_OLD_RERUN_MODES[mode]!r}")
        _check_literals(values, "RerunStateMachineConfig")
        return build(RerunConfig, values, overrides, source="overrides")


__all__ = ["bridge_field", "bridge_fields", "check_fault_tolerance", "inprocess_config", "rerun_config",
           "simulated_fault", "straggler_config"]
