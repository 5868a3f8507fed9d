"""StragglerConfig: validation, YAML preset, layering, Megatron-Bridge translation."""

import os

import pytest

from nvrx_core.config import ConfigError
from nvrx_core.straggler import StragglerConfig

PRESET = os.path.join(os.path.dirname(__file__), "..", "configs", "straggler.yaml")


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("report_time_interval", 0, "> 0"),
        ("report_time_interval", "60", "> 0"),
        ("relative_perf_threshold", 1.5, "(0, 1]"),
        ("individual_perf_threshold", 0, "(0, 1]"),
        ("consecutive_reports", 0, ">= 1"),
        ("profiling_interval", 2.5, ">= 1"),
        ("warmup_reports", -1, ">= 0"),
        ("num_scores_to_print", True, ">= 0"),
        ("stop_if_detected", "yes", "true or false"),
        ("cuda_timing", "maybe", "auto, on, off"),
        ("control_file", "", "non-empty"),
    ],
)
def test_bad_values_name_field_value_and_rule(field, value, words):
    with pytest.raises(ConfigError) as e:
        StragglerConfig(**{field: value})
    assert field in str(e.value) and repr(value) in str(e.value) and words in str(e.value)


def test_both_scores_off_is_rejected():
    with pytest.raises(ConfigError, match="at least one of calc_relative_perf"):
        StragglerConfig(calc_relative_perf=False, calc_individual_perf=False)


def test_preset_loads_and_overrides_win():
    loaded = StragglerConfig.from_yaml(PRESET)
    assert loaded == StragglerConfig()  # the preset documents the defaults
    assert StragglerConfig.from_yaml(PRESET, stop_if_detected=True).stop_if_detected is True


def test_yaml_unknown_key_and_missing_section(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("straggler:\n  report_interval: 5\n")
    with pytest.raises(ConfigError, match="unknown field 'report_interval'"):
        StragglerConfig.from_yaml(str(bad))
    other = tmp_path / "other.yaml"
    other.write_text("fault_tolerance:\n  x: 1\n")
    with pytest.raises(ConfigError, match="no 'straggler:' section"):
        StragglerConfig.from_yaml(str(other))


def test_nested_yaml_section(tmp_path):
    nested = tmp_path / "nested.yaml"
    nested.write_text("trainer:\n  resiliency:\n    straggler:\n      report_time_interval: 5\n")
    assert StragglerConfig.from_yaml(str(nested)).report_time_interval == 5
