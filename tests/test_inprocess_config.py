"""InProcessConfig: every rule gives a clear error naming the field, before training starts."""

import datetime
import os
import signal

import pytest

from nvrx_core.config import ConfigError
from nvrx_core.inprocess import InProcessConfig, Wrapper

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("overrides, message", [
    ({"soft_timeout": 90, "hard_timeout": 60}, "need soft_timeout < hard_timeout < barrier_timeout"),
    ({"hard_timeout": 200}, "need soft_timeout < hard_timeout < barrier_timeout"),
    ({"heartbeat_interval": 40}, "heartbeat_interval=40: must be < heartbeat_timeout"),
    ({"heartbeat_timeout": 150}, "heartbeat_timeout=150: must be < barrier_timeout"),
    ({"monitor_interval": 61}, "monitor_interval=61: must be < soft_timeout"),
    ({"soft_timeout": -1}, "soft_timeout=-1: must be > 0"),
    ({"soft_timeout": "fast"}, "soft_timeout='fast': must be a number of seconds"),
    ({"termination_grace": -1}, "termination_grace=-1: >= 0"),
    ({"max_iterations": 0}, "max_iterations=0: must be None or an integer >= 1"),
    ({"max_rank_faults": -1}, "max_rank_faults=-1: must be None or an integer >= 0"),
    ({"active_world_size": 2, "min_active_world_size": 3}, "min_active_world_size=3: must be <= active_world_size"),
    ({"granularity": "gpu"}, "granularity='gpu': must be one of"),
    ({"monitor_log_dir": "relative/dir"}, "monitor_log_dir='relative/dir': must be None or an absolute path"),
    ({"interrupt_signal": "SIGKILL"}, "interrupt_signal='SIGKILL': cannot be caught"),
    ({"interrupt_signal": "SIGNOPE"}, "interrupt_signal='SIGNOPE': is not a signal name"),
    ({"termination_signal": "stop"}, "termination_signal='stop': does not end a process"),
    ({"interrupt_signal": "SIGTERM"}, "interrupt_signal='SIGTERM': must differ from termination_signal"),
    ({"enabled": "yes"}, "enabled='yes': must be true or false"),
])
def test_bad_values_are_rejected_with_the_rule(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        InProcessConfig(**overrides)


def test_signals_in_every_spelling_are_kept_as_names():
    config = InProcessConfig(interrupt_signal="USR1", termination_signal="term", stack_dump_signal=12)  # were refused
    assert (config.interrupt_signal, config.termination_signal, config.stack_dump_signal) == ("SIGUSR1", "SIGTERM", "SIGUSR2")
    assert config.signal_number("stack_dump_signal") == signal.SIGUSR2
    assert InProcessConfig(stack_dump_signal=None).signal_number("stack_dump_signal") is None


def test_timedelta_values_become_seconds():
    config = InProcessConfig(soft_timeout=datetime.timedelta(seconds=5), hard_timeout=datetime.timedelta(minutes=1))
    assert config.soft_timeout == 5.0 and config.hard_timeout == 60.0


def test_world_rules_checked_with_the_world_size():
    config = InProcessConfig(active_world_size=6, min_active_world_size=5)
    config.check_world(8)
    with pytest.raises(ConfigError, match=r"active_world_size=6: must be <= the world size \(4\)"):
        config.check_world(4)


def test_yaml_preset_loads_and_layers(tmp_path):
    preset = InProcessConfig.from_layers(os.path.join(REPO, "configs", "inprocess.yaml"))
    assert preset == InProcessConfig()  # the preset documents the defaults
    custom = tmp_path / "job.yaml"
    custom.write_text("job:\n  inprocess:\n    soft_timeout: 30\n    max_iterations: 5\n")
    config = InProcessConfig.from_layers(str(custom), {"max_iterations": 7})
    assert config.soft_timeout == 30 and config.max_iterations == 7
    custom.write_text("inprocess:\n  soft_timeot: 30\n")
    with pytest.raises(ConfigError, match="unknown field 'soft_timeot'"):
        InProcessConfig.from_layers(str(custom))


def test_wrapper_accepts_a_config_and_keyword_overrides():
    wrapper = Wrapper(InProcessConfig(soft_timeout=10, hard_timeout=20), max_iterations=3)
    assert (wrapper.config.soft_timeout, wrapper.config.max_iterations) == (10, 3)
    with pytest.raises(ConfigError, match="hard_timeout"):
        Wrapper(InProcessConfig(soft_timeout=10, hard_timeout=20), hard_timeout=5)


def test_disabled_wrapper_returns_the_function_unchanged():
    def train():
        return 42

    assert Wrapper(enabled=False)(train) is train
