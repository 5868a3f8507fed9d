"""NVRX_FT_CONFIG, the fault-tolerance config a scheduler plugin hands ft_launcher through the
job's environment: what goes in comes out, ft_launcher layers it between the YAML file and its
flags, and a value it cannot read stops the launcher with the variable named."""

import pytest

from harness.launcher import run_launcher
from nvrx_core.config import ConfigError
from nvrx_core.exit_codes import ExitCode
from nvrx_core.ft import config_env
from nvrx_core.ft.launcher_args import build_parser, load_ft_config


def test_what_goes_in_comes_out():
    values = {"initial_rank_heartbeat_timeout": None, "rank_heartbeat_timeout": 12.5,
              "rank_section_timeouts": {"setup": 600, "step": None}, "rank_termination_signal": "SIGTERM",
              "num_warmup_iterations": 2, "log_level": "DEBUG"}
    text = config_env.encode(values)
    assert text == ("initial_rank_heartbeat_timeout=null,rank_heartbeat_timeout=12.5,rank_section_timeouts.setup=600,"
                    "rank_section_timeouts.step=null,rank_termination_signal=SIGTERM,num_warmup_iterations=2,"
                    "log_level=DEBUG")
    assert config_env.decode(text) == values
    assert config_env.decode("") == {}


@pytest.mark.parametrize("values, message", [
    ({"log_level": "two words"}, "log_level='two words'"),
    ({"rank_heartbeat_timeout": float("inf")}, "not a finite number"),
    ({"bad-name": 1}, "not a field name"),
    ({"rank_section_timeouts": {"a,b": 1}}, "not a field name"),
])
def test_a_value_no_unquoted_shell_export_keeps_is_refused_when_encoding(values, message):
    with pytest.raises(ConfigError, match="NVRX_FT_CONFIG") as raised:
        config_env.encode(values)
    assert message in str(raised.value)


@pytest.mark.parametrize("text, message", [
    ("rank_heartbeat_timeout", "is not field=value"),
    ("rank_heartbeat_timeout=1,=2", "is not field=value"),
    ("rank_heartbeat_timeout.x=1", "only rank_section_timeouts.<section>"),
    ("rank_section_timeouts.a.b=1", "only rank_section_timeouts.<section>"),
])
def test_a_value_it_cannot_read_is_named(text, message):
    with pytest.raises(ConfigError, match="NVRX_FT_CONFIG") as raised:
        config_env.decode(text)
    assert message in str(raised.value)


def test_the_environment_sits_between_the_yaml_file_and_the_flags(tmp_path, monkeypatch):
    path = tmp_path / "ft.yaml"
    path.write_text("fault_tolerance:\n  rank_heartbeat_timeout: 100\n  initial_rank_heartbeat_timeout: 200\n"
                    "  workload_check_interval: 3\n")
    monkeypatch.setenv("NVRX_FT_CONFIG", "rank_heartbeat_timeout=50,rank_section_timeouts.step=30")
    cfg = load_ft_config(build_parser().parse_args(["--ft-cfg-path", str(path), "--ft-workload-check-interval", "1",
                                                    "--ft-rank-heartbeat-timeout", "20", "train.py"]))
    assert (cfg.initial_rank_heartbeat_timeout, cfg.workload_check_interval) == (200, 1)  # YAML; flag
    assert (cfg.rank_heartbeat_timeout, cfg.rank_section_timeouts) == (20, {"step": 30})   # flag over env; env
    monkeypatch.setenv("NVRX_FT_CONFIG", "rank_heartbeat_timeout=50,no_such_field=1")
    with pytest.raises(ConfigError, match="no_such_field"):
        load_ft_config(build_parser().parse_args(["train.py"]))


def test_ft_launcher_refuses_a_bad_value_before_starting_anything(tmp_path):
    result = run_launcher(["--nproc-per-node", "1", str(tmp_path / "never_started.py")], timeout=120,
                          env={"NVRX_FT_CONFIG": "rank_heartbeat_timeout=-5"})
    assert result.returncode == ExitCode.CONFIG_ERROR, result.stdout[-2000:]
    assert "rank_heartbeat_timeout" in result.stdout
