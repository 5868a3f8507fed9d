"""ft_launcher's configuration layers and edge mappings, parsed without starting a job."""

import pytest

from nvrx_core.config import ConfigError
from nvrx_core.exit_codes import PREEMPTED_EXIT_CODE_ENV
from nvrx_core.ft.launcher_args import attach_flag_values, build_parser, load_ft_config, preempted_exit_code

# What NeMo-Run 0.11's ft_launcher component writes (underscore spellings, zero values dropped).
NEMO_RUN_ARGV = ["--ft-workload_check_interval", "5", "--ft-initial_rank_heartbeat_timeout", "1800",
                 "--ft-rank_heartbeat_timeout", "300", "--ft-rank_termination_signal", "SIGKILL",
                 "--ft-log_level", "INFO", "--max-restarts", "3", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", "localhost:0", "--rdzv-id", "8424", "--nnodes", "1", "--nproc-per-node", "2",
                 "--node-rank", "0", "--tee", "3", "--no-python", "/opt/train.py", "--save", "/ckpt"]


def test_every_flag_nemo_run_writes_is_accepted():
    args = build_parser().parse_args(NEMO_RUN_ARGV)
    cfg = load_ft_config(args)
    assert (cfg.workload_check_interval, cfg.initial_rank_heartbeat_timeout, cfg.rank_heartbeat_timeout) == \
        (5, 1800, 300)
    assert args.max_restarts == 3 and args.training_script_args == ["--save", "/ckpt"]
    assert build_parser().parse_args(["--ignore-missing-fault-tol-cfg", "train.py"]).ignore_missing_fault_tol_cfg


# nvidia-resiliency-ext 0.4.1's spellings of its node-level options (its launcher's own argparse).
NVRX_NODE_FLAGS = ["--ft-param-enable-nic-monitor", "--ft_param_enable_nic_monitor", "--ft-param-pci-topo-file",
                   "--ft_param_pci_topo_file", "--ft-param-link-down-path-template",
                   "--ft_param_link_down_path_template"]


@pytest.mark.parametrize("flag", NVRX_NODE_FLAGS)
def test_nvidia_resiliency_exts_node_flags_are_accepted_and_have_no_effect(flag, caplog):
    args = build_parser().parse_args([flag, "x", "--ft_param_rank_heartbeat_timeout", "7", "train.py"])
    with caplog.at_level("WARNING"):
        cfg = load_ft_config(args)
    assert cfg.rank_heartbeat_timeout == 7
    assert flag.split("param", 1)[1].strip("-_").replace("-", "_") in caplog.text  # named as having no effect


def test_a_missing_file_named_by_the_environment_only_warns(tmp_path, monkeypatch, caplog):
    """NeMo-Run's Slurm template exports FAULT_TOL_CFG_PATH whether or not the file was written."""
    missing = str(tmp_path / "never_written.yml")
    monkeypatch.setenv("FAULT_TOL_CFG_PATH", missing)
    with caplog.at_level("WARNING", logger="nvrx.ft.launcher"):
        cfg = load_ft_config(build_parser().parse_args(["--ft-rank-heartbeat-timeout", "42", "train.py"]))
    assert cfg.rank_heartbeat_timeout == 42 and missing in caplog.text
    with pytest.raises(ConfigError, match="does not exist"):  # named on the command line: an error
        load_ft_config(build_parser().parse_args(["--ft-cfg-path", missing, "train.py"]))


def test_the_preempted_exit_code_mapping_is_checked(monkeypatch):
    monkeypatch.delenv(PREEMPTED_EXIT_CODE_ENV, raising=False)
    assert preempted_exit_code() is None
    monkeypatch.setenv(PREEMPTED_EXIT_CODE_ENV, "0")
    assert preempted_exit_code() == 0
    for bad in ("-1", "256", "requeue"):
        monkeypatch.setenv(PREEMPTED_EXIT_CODE_ENV, bad)
        with pytest.raises(ConfigError, match=f"NVRX_PREEMPTED_EXIT_CODE={bad!r}"):
            preempted_exit_code()


@pytest.mark.parametrize("flag", ["--ft-use-infra-group-rank", "--ft_use_infra_group_rank"])
def test_a_bare_infra_rank_flag_before_the_script_does_not_swallow_it(flag):
    # the srun line of docs/slurm.md: the flag last, then the training script
    args = build_parser().parse_args(attach_flag_values(["--nnodes", "2", flag, "train.py", "--lr", "1"]))
    assert args.ft_use_infra_group_rank is True
    assert args.training_script == "train.py" and args.training_script_args == ["--lr", "1"]
    for value, expected in (("false", False), ("true", True)):
        args = build_parser().parse_args(attach_flag_values([flag, value, "train.py"]))
        assert args.ft_use_infra_group_rank is expected and args.training_script == "train.py"
