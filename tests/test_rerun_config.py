"""RerunConfig: Megatron-Bridge-compatible fields, validation naming field/value/rule, YAML layers."""

from pathlib import Path

import pytest

from nvrx_core.config import ConfigError
from nvrx_core.rerun import RerunConfig, RerunDiagnostic, RerunMode, RerunStateMachineConfig

PRESET = Path(__file__).resolve().parents[1] / "configs" / "rerun.yaml"


def test_defaults_match_megatron_bridge():
    config = RerunStateMachineConfig()
    assert RerunStateMachineConfig is RerunConfig
    assert config.rerun_mode is RerunMode.DISABLED
    assert config.check_for_nan_in_loss is True and config.check_for_spiky_loss is False
    assert config.spiky_loss_factor == 10.0
    assert config.error_injection_rate == 0
    assert config.error_injection_type is RerunDiagnostic.TRANSIENT_ERROR
    assert config.result_rejected_tracker_filename is None


def test_megatron_lm_report_stats_spelling_is_accepted():
    assert RerunConfig(rerun_mode="report_stats").rerun_mode is RerunMode.REPORT_DETERMINISM_STATS
    assert RerunConfig(rerun_mode="validate_results").rerun_mode is RerunMode.VALIDATE_RESULTS


@pytest.mark.parametrize("field, value, rule", [
    ("rerun_mode", "validate", "must be one of disabled, validate_results, report_determinism_stats"),
    ("error_injection_type", "silent", "must be one of correct_result, transient_error, persistent_error"),
    ("check_for_nan_in_loss", "yes", "must be true or false"),
    ("spiky_loss_factor", 1.0, "must be a finite number > 1"),
    ("spiky_loss_factor", float("nan"), "must be a finite number > 1"),
    ("error_injection_rate", -1, "must be an integer >= 0"),
    ("error_injection_rate", 2.5, "must be an integer >= 0"),
    ("spiky_loss_window", 0, "must be an integer >= 1"),
    ("spiky_loss_min_samples", 500, "must be <= spiky_loss_window (100)"),
    ("max_same_device_restarts", True, "must be an integer >= 0"),
    ("result_rejected_tracker_filename", "  ", "must be a non-empty path or null"),
])
def test_bad_values_name_field_value_and_rule(field, value, rule):
    with pytest.raises(ConfigError) as info:
        RerunConfig(**{field: value})
    assert str(info.value).startswith(f"{field}={value!r}: ") and rule in str(info.value)


def test_preset_yaml_loads_and_overrides_win(tmp_path):
    preset = RerunConfig.from_layers(str(PRESET))
    assert preset.rerun_mode is RerunMode.VALIDATE_RESULTS and preset.check_for_spiky_loss
    merged = RerunConfig.from_layers(str(PRESET), {"spiky_loss_factor": 5, "rerun_mode": "disabled"})
    assert merged.spiky_loss_factor == 5.0 and merged.rerun_mode is RerunMode.DISABLED
    assert merged.spiky_loss_window == preset.spiky_loss_window


def test_yaml_errors_are_clear(tmp_path):
    nested = tmp_path / "nested.yaml"
    nested.write_text("model:\n  rerun_state_machine:\n    rerun_mode: report_stats\n")
    assert RerunConfig.from_layers(str(nested)).rerun_mode is RerunMode.REPORT_DETERMINISM_STATS
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("rerun_state_machine:\n  rerun_modus: disabled\n")
    with pytest.raises(ConfigError, match="unknown field 'rerun_modus' for RerunConfig"):
        RerunConfig.from_layers(str(unknown))
    missing = tmp_path / "missing.yaml"
    missing.write_text("other: {}\n")
    with pytest.raises(ConfigError, match="has no 'rerun_state_machine:' section"):
        RerunConfig.from_layers(str(missing))
    bad = tmp_path / "bad.yaml"
    bad.write_text("rerun_state_machine:\n  spiky_loss_factor: 0.5\n")
    with pytest.raises(ConfigError, match=r"spiky_loss_factor=0.5: must be a finite number > 1"):
        RerunConfig.from_layers(str(bad))
