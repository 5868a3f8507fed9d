"""nvrx_megatron's configs: field-by-field parity with Megatron-Bridge, checks, conversions.

The parity table below is transcribed by hand from Megatron-Bridge,
NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/training/config.py (classes
FaultToleranceConfig, NVRxStragglerDetectionConfig, InProcessRestartConfig at commit
4feb11f80e19fda2937f983688218300436e2177, unchanged at 003e863ad19f6db7958d976c961a0d7d9abb1314;
RerunStateMachineConfig at 003e863, where it became `@dataclass(kw_only=True)` deriving from
Megatron-LM's megatron/training/config/resilience_config.py: the same six fields, order and
defaults as the plain dataclass of 4feb11f). It is data, not code: the test compares our
dataclasses against it.
"""

import dataclasses
import os
import signal
import typing

import pytest

from nvrx_core.config import ConfigError
from nvrx_core.ft.faults import SimulatedFault
from nvrx_core.inprocess import InProcessConfig
from nvrx_core.rerun import RerunConfig, RerunDiagnostic, RerunMode
from nvrx_core.straggler import StragglerConfig
from nvrx_megatron import (FaultToleranceConfig, InProcessRestartConfig, NVRxStragglerDetectionConfig,
                           RerunStateMachineConfig)

# class -> (kw_only, [(field, default, Literal values or None), ...] in Bridge's order)
BRIDGE = {
    FaultToleranceConfig: (False, [
        ("enable_ft_package", False, None),
        ("calc_ft_timeouts", False, None),
        ("simulate_fault", False, None),
        ("simulated_fault_type", "random", ("rank_hung", "rank_killed", "random")),
        ("simulated_fault_rank", None, None),
        ("simulated_fault_base_delay", 0, None),
    ]),
    NVRxStragglerDetectionConfig: (False, [
        ("enabled", False, None),
        ("report_time_interval", 300.0, None),
        ("calc_relative_gpu_perf", True, None),
        ("calc_individual_gpu_perf", True, None),
        ("num_gpu_perf_scores_to_print", 5, None),
        ("gpu_relative_perf_threshold", 0.7, None),
        ("gpu_individual_perf_threshold", 0.7, None),
        ("stop_if_detected", False, None),
        ("enable_logging", True, None),
        ("profiling_interval", 1, None),
        ("logger_name", "megatron.bridge.NVRxStragglerDetection", None),
    ]),
    InProcessRestartConfig: (False, [
        ("enabled", False, None),
        ("max_iterations", None, None),
        ("monitor_thread_interval", 1.0, None),
        ("monitor_process_interval", 1.0, None),
        ("progress_watchdog_interval", 1.0, None),
        ("heartbeat_interval", 30.0, None),
        ("soft_timeout", 60.0, None),
        ("hard_timeout", 90.0, None),
        ("heartbeat_timeout", 60.0, None),
        ("barrier_timeout", 120.0, None),
        ("completion_timeout", 120.0, None),
        ("last_call_wait", 1.0, None),
        ("termination_grace_time", 1.0, None),
        ("granularity", "node", ("node", "rank")),
        ("active_world_size", None, None),
        ("empty_cuda_cache", True, None),
        ("max_rank_faults", None, None),
        ("monitor_process_logdir", None, None),
    ]),
    RerunStateMachineConfig: (True, [
        ("error_injection_rate", 0, None),
        ("error_injection_type", "transient_error", ("correct_result", "transient_error", "persistent_error")),
        ("rerun_mode", "disabled", ("disabled", "validate_results", "report_determinism_stats")),
        ("check_for_nan_in_loss", True, None),
        ("check_for_spiky_loss", False, None),
        ("spiky_loss_factor", 10.0, None),
    ]),
}
# Bridge declares a finalize() only on this one; ConfigContainer.validate() re-runs
# __post_init__ on the others precisely because they have none.
BRIDGE_FINALIZE = {NVRxStragglerDetectionConfig}


def _literal_values(cls, name):
    hint = typing.get_type_hints(cls)[name]
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None


@pytest.mark.parametrize("cls", list(BRIDGE), ids=lambda c: c.__name__)
def test_fields_match_bridge(cls):
    kw_only, table = BRIDGE[cls]
    ours = dataclasses.fields(cls)
    assert [f.name for f in ours[: len(table)]] == [name for name, _, _ in table]
    for field, (name, default, literal) in zip(ours, table):
        assert field.default == default and type(field.default) is type(default), name
        assert field.kw_only is kw_only, name
        assert _literal_values(cls, name) == literal, name
    for extra in ours[len(table):]:  # anything of ours comes after Bridge's and is optional
        assert extra.default is not dataclasses.MISSING or extra.default_factory is not dataclasses.MISSING
    assert hasattr(cls, "finalize") is (cls in BRIDGE_FINALIZE)


POSITIONAL = [cls for cls, (kw_only, _) in BRIDGE.items() if not kw_only]


@pytest.mark.parametrize("cls", POSITIONAL, ids=lambda c: c.__name__)
def test_positional_construction_fills_fields_in_bridges_order(cls):
    _, table = BRIDGE[cls]
    values = [default for _, default, _ in table]
    config = cls(*values)
    assert [getattr(config, name) for name, _, _ in table] == values
    with pytest.raises(TypeError):
        cls(*values, *[None] * (len(dataclasses.fields(cls)) - len(table) + 1))


def test_positional_values_land_in_the_right_field():
    ft = FaultToleranceConfig(True, True, True, "rank_killed", 1, 5)
    assert (ft.enable_ft_package, ft.simulated_fault_type, ft.simulated_fault_rank,
            ft.simulated_fault_base_delay) == (True, "rank_killed", 1, 5)
    # Bridge's RerunStateMachineConfig is keyword-only: the old positional call is told its keyword form.
    with pytest.raises(TypeError, match=r"keyword arguments only.*RerunStateMachineConfig\(error_injection_rate=10, "
                                        r"error_injection_type='persistent_error', rerun_mode='validate_results'\)"):
        RerunStateMachineConfig(10, "persistent_error", "validate_results")
    assert InProcessRestartConfig(True, 4).max_iterations == 4
    assert NVRxStragglerDetectionConfig(True, 30.0).report_time_interval == 30.0


# (class, field, bad value, words of the rule)
BAD = [
    (FaultToleranceConfig, "enable_ft_package", "yes", "True or False"),
    (FaultToleranceConfig, "calc_ft_timeouts", 1, "True or False"),
    (FaultToleranceConfig, "simulate_fault", None, "True or False"),
    (FaultToleranceConfig, "simulated_fault_type", "rank_exception", "Unknown fault type rank_exception"),
    (FaultToleranceConfig, "simulated_fault_rank", -1, "integer >= 0"),
    (FaultToleranceConfig, "simulated_fault_rank", "0", "integer >= 0"),
    (FaultToleranceConfig, "simulated_fault_base_delay", -5, ">= 0"),
    (FaultToleranceConfig, "simulated_fault_base_delay", float("inf"), ">= 0"),
    (NVRxStragglerDetectionConfig, "enabled", "true", "true or false"),
    (NVRxStragglerDetectionConfig, "report_time_interval", 0, "report_time_interval must be positive"),
    (NVRxStragglerDetectionConfig, "calc_relative_gpu_perf", 1, "true or false"),
    (NVRxStragglerDetectionConfig, "calc_individual_gpu_perf", "x", "true or false"),
    (NVRxStragglerDetectionConfig, "num_gpu_perf_scores_to_print", -1, ">= 0"),
    (NVRxStragglerDetectionConfig, "gpu_relative_perf_threshold", 1.5, "must be between 0.0 and 1.0"),
    (NVRxStragglerDetectionConfig, "gpu_individual_perf_threshold", 0.0, "(0, 1]"),
    (NVRxStragglerDetectionConfig, "stop_if_detected", "no", "true or false"),
    (NVRxStragglerDetectionConfig, "enable_logging", None, "true or false"),
    (NVRxStragglerDetectionConfig, "profiling_interval", 0, ">= 1"),
    (NVRxStragglerDetectionConfig, "logger_name", "", "non-empty"),
    (InProcessRestartConfig, "enabled", "yes", "true or false"),
    (InProcessRestartConfig, "max_iterations", 0, ">= 1"),
    (InProcessRestartConfig, "monitor_thread_interval", 0, "> 0"),
    (InProcessRestartConfig, "monitor_thread_interval", 70.0, "< soft_timeout"),
    (InProcessRestartConfig, "monitor_process_interval", 0, "> 0"),
    (InProcessRestartConfig, "progress_watchdog_interval", -1, "> 0"),
    (InProcessRestartConfig, "heartbeat_interval", 60.0, "< heartbeat_timeout"),
    (InProcessRestartConfig, "soft_timeout", 95.0, "soft_timeout < hard_timeout"),
    (InProcessRestartConfig, "hard_timeout", 130.0, "hard_timeout < barrier_timeout"),
    (InProcessRestartConfig, "heartbeat_timeout", 150.0, "< barrier_timeout"),
    (InProcessRestartConfig, "barrier_timeout", "2m", "number of seconds"),
    (InProcessRestartConfig, "completion_timeout", 0, "> 0"),
    (InProcessRestartConfig, "last_call_wait", -0.5, ">= 0"),
    (InProcessRestartConfig, "termination_grace_time", -1, ">= 0"),
    (InProcessRestartConfig, "granularity", "gpu", "one of 'node', 'rank'"),
    (InProcessRestartConfig, "active_world_size", 0, ">= 1"),
    (InProcessRestartConfig, "empty_cuda_cache", 1, "true or false"),
    (InProcessRestartConfig, "max_rank_faults", -1, ">= 0"),
    (InProcessRestartConfig, "monitor_process_logdir", "", "directory path"),
    (RerunStateMachineConfig, "error_injection_rate", -1, ">= 0"),
    (RerunStateMachineConfig, "error_injection_type", "bitflip", "one of 'correct_result'"),
    (RerunStateMachineConfig, "rerun_mode", "report_stats", "now calls this mode 'report_determinism_stats'"),
    (RerunStateMachineConfig, "rerun_mode", "skip", "one of 'disabled'"),
    (RerunStateMachineConfig, "check_for_nan_in_loss", "yes", "true or false"),
    (RerunStateMachineConfig, "check_for_spiky_loss", 0, "true or false"),
    (RerunStateMachineConfig, "spiky_loss_factor", 1.0, "> 1"),
]


@pytest.mark.parametrize("cls, field, value, words", BAD,
                         ids=[f"{c.__name__}.{f}={v!r}" for c, f, v, _ in BAD])
def test_each_rule_names_class_field_value_and_rule(cls, field, value, words):
    with pytest.raises(ConfigError) as raised:
        cls(**{field: value})
    message = str(raised.value)
    assert message.startswith(f"{cls.__name__}: ") and field in message, message
    assert words in message, message
    # a rule over several fields (soft < hard < barrier) shows them all: name/name=(values)
    assert f"{field}={value!r}" in message or repr(value) in message.partition("=")[2], message


def test_every_bridge_field_has_a_rule_tested():
    """Bridge validates only two straggler rules; each of our fields is checked by some rule."""
    tested = {(cls, field) for cls, field, _, _ in BAD}
    for cls, (_, table) in BRIDGE.items():
        for name, _, _ in table:
            assert (cls, name) in tested, f"{cls.__name__}.{name} has no failing-value test"


def test_core_names_never_leak_into_errors():
    with pytest.raises(ConfigError) as raised:
        NVRxStragglerDetectionConfig(calc_relative_gpu_perf=False, calc_individual_gpu_perf=False)
    assert "At least one of calc_relative_gpu_perf or calc_individual_gpu_perf must be True" in str(raised.value)
    assert "calc_relative_perf" not in str(raised.value)
    with pytest.raises(ConfigError, match=r"monitor_thread_interval=1\.0: must be < soft_timeout"):
        InProcessRestartConfig(soft_timeout=0.5, hard_timeout=90.0)


def test_changed_fields_are_checked_again_where_bridge_checks_them():
    straggler = NVRxStragglerDetectionConfig()
    straggler.gpu_relative_perf_threshold = 2.0  # Bridge: change fields, then finalize()
    with pytest.raises(ConfigError, match="gpu_relative_perf_threshold=2.0"):
        straggler.finalize()
    restart = InProcessRestartConfig()
    restart.granularity = "gpu"  # Bridge's ConfigContainer.validate() re-runs __post_init__
    with pytest.raises(ConfigError, match="granularity='gpu'"):
        restart.__post_init__()
    with pytest.raises(ConfigError, match="granularity='gpu'"):
        restart.to_inprocess_config()


def test_enum_members_are_accepted_as_their_values():
    config = RerunStateMachineConfig(rerun_mode=RerunMode.VALIDATE_RESULTS,
                                     error_injection_type=RerunDiagnostic.CORRECT_RESULT)
    assert config.rerun_mode == "validate_results" and type(config.rerun_mode) is str
    assert config.error_injection_type == "correct_result"


def test_fault_tolerance_converts_to_bridges_simulated_fault():
    assert FaultToleranceConfig().to_simulated_fault() is None
    config = FaultToleranceConfig(enable_ft_package=True, simulate_fault=True, simulated_fault_type="rank_hung",
                                  simulated_fault_rank=1, simulated_fault_base_delay=30)
    fault = config.to_simulated_fault(seed=7)
    assert fault == SimulatedFault(fault_type="rank_hung", rank_to_fail=1, base_delay=30.0, jitter=6.0, seed=7)
    # Bridge's defaults: a random kind on a random rank, right away.
    fault = FaultToleranceConfig(simulate_fault=True).to_simulated_fault()
    assert (fault.fault_type, fault.rank_to_fail, fault.base_delay, fault.jitter) == ("random", None, 0.0, 0.0)


def test_straggler_converts_with_bridges_values():
    core = NVRxStragglerDetectionConfig().to_straggler_config()
    assert isinstance(core, StragglerConfig)
    # Bridge's defaults where the core's differ (core: enabled, 60 s, 0.8, 0.8).
    assert (core.enabled, core.report_time_interval) == (False, 300.0)
    assert (core.relative_perf_threshold, core.individual_perf_threshold) == (0.7, 0.7)
    assert core.logger_name == "megatron.bridge.NVRxStragglerDetection" and core.gather_on_rank0 is True
    config = NVRxStragglerDetectionConfig(True, 10.0, False, True, 0, 0.5, 0.6, True, False, 4, "my.log")
    core = config.to_straggler_config(consecutive_reports=1)
    assert (core.enabled, core.report_time_interval, core.calc_relative_perf, core.calc_individual_perf) == (
        True, 10.0, False, True)
    assert (core.num_scores_to_print, core.relative_perf_threshold, core.individual_perf_threshold) == (0, 0.5, 0.6)
    assert (core.stop_if_detected, core.enable_logging, core.profiling_interval, core.logger_name) == (
        True, False, 4, "my.log")
    assert core.consecutive_reports == 1
    with pytest.raises(ConfigError, match="NVRxStragglerDetectionConfig: .*unknown field 'bogus'"):
        config.to_straggler_config(bogus=1)


def test_inprocess_converts_with_bridges_values(tmp_path, monkeypatch):
    core = InProcessRestartConfig().to_inprocess_config()
    assert isinstance(core, InProcessConfig)
    # Bridge's defaults where the core's differ (core: rank, 1 s, 30 s, 5 s).
    assert (core.granularity, core.heartbeat_interval, core.heartbeat_timeout, core.termination_grace) == (
        "node", 30.0, 60.0, 1.0)
    assert (core.enabled, core.soft_timeout, core.hard_timeout, core.barrier_timeout, core.completion_timeout,
            core.monitor_interval, core.empty_cuda_cache) == (False, 60.0, 90.0, 120.0, 120.0, 1.0, True)
    monkeypatch.chdir(tmp_path)
    config = InProcessRestartConfig(enabled=True, max_iterations=3, monitor_thread_interval=0.25, soft_timeout=5.0,
                                    hard_timeout=8.0, heartbeat_interval=0.5, heartbeat_timeout=4.0,
                                    barrier_timeout=20.0, completion_timeout=15.0, termination_grace_time=2.0,
                                    granularity="rank", active_world_size=3, empty_cuda_cache=False,
                                    max_rank_faults=2, monitor_process_logdir="logs")
    core = config.to_inprocess_config(interrupt_signal="SIGUSR2", stack_dump_signal=None)
    assert (core.enabled, core.max_iterations, core.monitor_interval, core.soft_timeout, core.hard_timeout) == (
        True, 3, 0.25, 5.0, 8.0)
    assert (core.heartbeat_interval, core.heartbeat_timeout, core.barrier_timeout, core.completion_timeout) == (
        0.5, 4.0, 20.0, 15.0)
    assert (core.termination_grace, core.granularity, core.active_world_size, core.empty_cuda_cache,
            core.max_rank_faults) == (2.0, "rank", 3, False, 2)
    assert core.monitor_log_dir == os.path.join(str(tmp_path), "logs")  # a relative Bridge path, made absolute
    assert core.signal_number("interrupt_signal") == signal.SIGUSR2


def test_rerun_converts_with_bridges_values():
    core = RerunStateMachineConfig().to_rerun_config()
    assert isinstance(core, RerunConfig)
    assert (core.rerun_mode, core.error_injection_type, core.error_injection_rate) == (
        RerunMode.DISABLED, RerunDiagnostic.TRANSIENT_ERROR, 0)
    assert (core.check_for_nan_in_loss, core.check_for_spiky_loss, core.spiky_loss_factor) == (True, False, 10.0)
    config = RerunStateMachineConfig(error_injection_rate=100, error_injection_type="persistent_error",
                                     rerun_mode="report_determinism_stats", check_for_nan_in_loss=False,
                                     check_for_spiky_loss=True, spiky_loss_factor=4.0)
    core = config.to_rerun_config(spiky_loss_window=50, result_rejected_tracker_filename="rejected.jsonl")
    assert (core.rerun_mode, core.error_injection_type, core.error_injection_rate) == (
        RerunMode.REPORT_DETERMINISM_STATS, RerunDiagnostic.PERSISTENT_ERROR, 100)
    assert (core.check_for_nan_in_loss, core.check_for_spiky_loss, core.spiky_loss_factor) == (False, True, 4.0)
    assert (core.spiky_loss_window, core.result_rejected_tracker_filename) == (50, "rejected.jsonl")
