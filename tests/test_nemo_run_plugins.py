"""nvrx_nemo_run's plugins against real nemo_run objects (no training here: the runs are in
tests/test_nemo_run_jobs.py): Bridge parity, what each kind of task gets, what the executor
gets, a Slurm dry run's sbatch script, and the errors."""

import dataclasses
import os
import shlex
import subprocess
import sys

import fiddle as fdl
import pytest

nemo_run = pytest.importorskip("nemo_run")
run = nemo_run

from nvrx_core.config import ConfigError  # noqa: E402
from nvrx_core.ft.launcher_args import build_parser, load_ft_config  # noqa: E402
from nvrx_lightning import NVRxFaultTolerance, NVRxPreemption, NVRxStragglerDetection  # noqa: E402
from nvrx_megatron import FaultToleranceConfig, NVRxStragglerDetectionConfig  # noqa: E402
from nvrx_nemo_run import (FaultTolerancePlugin, FaultTolerancePluginScriptArgs, InProcessRestartPlugin,  # noqa: E402
                           PreemptionPlugin, PreemptionPluginScriptArgs, StragglerDetectionPlugin)

# Megatron-Bridge src/megatron/bridge/recipes/run_plugins.py (NVIDIA-NeMo/Megatron-Bridge @067f987):
# (field, default) in declaration order, after nemo_run.Plugin's experiment_id.
BRIDGE_FT = [("enable_ft_package", True), ("calc_ft_timeouts", True), ("num_in_job_restarts", 3),
             ("num_job_retries_on_failure", 2), ("initial_rank_heartbeat_timeout", 1800),
             ("rank_heartbeat_timeout", 300), ("script_args_converter_fn", None)]
BRIDGE_PREEMPTION = [("preempt_time", 60), ("enable_exit_handler", True),
                     ("enable_exit_handler_for_data_loader", False), ("script_args_converter_fn", None)]
BRIDGE_FT_ARGS = ["ft.enable_ft_package=true", "ft.calc_ft_timeouts=true"]
BRIDGE_PREEMPTION_ARGS = ["train.exit_signal_handler=True", "train.exit_signal_handler_for_dataloader=False"]


def _fields(cls):
    return [(f.name, f.default) for f in dataclasses.fields(cls) if f.init]


def test_bridge_fields_defaults_and_order_come_first():
    assert _fields(FaultTolerancePlugin)[:len(BRIDGE_FT)] == BRIDGE_FT
    assert _fields(PreemptionPlugin)[:len(BRIDGE_PREEMPTION)] == BRIDGE_PREEMPTION
    assert [name for name, _ in _fields(PreemptionPlugin)][len(BRIDGE_PREEMPTION):] == ["sig", "callbacks"]
    for cls in (FaultTolerancePlugin, PreemptionPlugin):
        assert issubclass(cls, run.Plugin) and all(f.kw_only for f in dataclasses.fields(cls) if f.init)
        with pytest.raises(TypeError):
            cls(True)                                          # keyword-only, as in Bridge
    assert [f.name for f in dataclasses.fields(FaultTolerancePluginScriptArgs)] == ["enable_ft_package",
                                                                                   "calc_ft_timeouts"]
    assert [f.name for f in dataclasses.fields(PreemptionPluginScriptArgs)] == [
        "enable_exit_handler", "enable_exit_handler_for_data_loader"]


def _executor(tmp_path, **kwargs):
    executor = run.LocalExecutor(ntasks_per_node=2, **kwargs)
    executor.assign("exp", str(tmp_path / "exp"), task_id="job", task_dir="job")
    return executor


def _script():
    return run.Script(path="train.py", args=["--save", "/ckpt"])


def test_a_script_gets_bridges_arguments_and_the_executor_our_launcher(tmp_path):
    executor, task = _executor(tmp_path), _script()
    FaultTolerancePlugin().setup(task, executor)
    PreemptionPlugin().setup(task, executor)
    assert task.args == ["--save", "/ckpt", *BRIDGE_FT_ARGS, *BRIDGE_PREEMPTION_ARGS]
    launcher = executor.launcher
    assert isinstance(launcher, run.FaultTolerance)
    assert (launcher.max_restarts, launcher.initial_rank_heartbeat_timeout, launcher.rank_heartbeat_timeout) == \
        (3, 1800, 300)
    assert executor.retries == 2
    assert executor.env_vars["FAULT_TOL_FINISHED_FLAG_FILE"] == str(tmp_path / "exp" / "job" / "finished_flag")
    assert "NVRX_PREEMPTED_EXIT_CODE" not in executor.env_vars   # a local job keeps exit 18


def test_the_launcher_is_never_all_unset(tmp_path):
    """With every field unset NeMo-Run would write --ignore-missing-fault-tol-cfg and no --ft-* flag."""
    executor = _executor(tmp_path)
    FaultTolerancePlugin(num_in_job_restarts=0, initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None,
                         rank_section_timeouts={"step": 60}, rank_out_of_section_timeout=60).setup(_script(), executor)
    assert executor.launcher.workload_check_interval == 5.0


def test_a_custom_converter_replaces_the_hydra_overrides(tmp_path):
    task = _script()
    FaultTolerancePlugin(script_args_converter_fn=lambda a: [f"--ft={a.enable_ft_package}"]).setup(
        task, _executor(tmp_path))
    assert task.args[-1] == "--ft=True"
    PreemptionPlugin(enable_exit_handler=False).setup(task, _executor(tmp_path))
    assert task.args[-1] == "--ft=True"                           # Bridge: nothing when the handler is off


def _exported(value):
    """NVRX_FT_CONFIG as the job sees it after NeMo-Run's Slurm template's unquoted `export K=V`."""
    out = subprocess.run(["bash", "-c", f"export NVRX_FT_CONFIG={value}\nprintenv NVRX_FT_CONFIG"],
                         capture_output=True, text=True, check=True)
    return out.stdout.rstrip("\n")


def test_the_executor_environment_carries_what_nemo_runs_command_line_cannot(tmp_path, monkeypatch):
    executor = _executor(tmp_path)
    plugin = FaultTolerancePlugin(initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None,
                                  rank_section_timeouts={"setup": 600, "step": 60, "checkpointing": 120},
                                  rank_out_of_section_timeout=60, workload_check_interval=2)
    plugin.setup(_script(), executor)
    assert "FAULT_TOL_CFG_PATH" not in executor.env_vars
    value = executor.env_vars["NVRX_FT_CONFIG"]
    assert _exported(value) == value                                   # survives an unquoted shell export
    # ft_launcher reads it: heartbeats off (NeMo-Run would have dropped the None), sections on
    monkeypatch.setenv("NVRX_FT_CONFIG", value)
    monkeypatch.setenv("FAULT_TOL_CFG_PATH", str(tmp_path / "never_written.yml"))  # as the Slurm template
    cfg = load_ft_config(build_parser().parse_args(["train.py"]))
    assert cfg.rank_heartbeat_timeout is None and cfg.initial_rank_heartbeat_timeout is None
    assert cfg.rank_section_timeouts == {"setup": 600, "step": 60, "checkpointing": 120}
    assert (cfg.rank_out_of_section_timeout, cfg.workload_check_interval) == (60, 2)
    # the command line NeMo-Run writes still has the last word
    cfg = load_ft_config(build_parser().parse_args(["--ft-rank-out-of-section-timeout", "90", "train.py"]))
    assert (cfg.rank_out_of_section_timeout, cfg.rank_section_timeouts["step"]) == (90, 60)


def test_restart_policy_reaches_the_launcher_through_the_environment(tmp_path, monkeypatch):
    executor = _executor(tmp_path)
    FaultTolerancePlugin().setup(_script(), executor)
    assert "NVRX_FT_RESTART_POLICY" not in executor.env_vars                 # default: ft_launcher's own
    FaultTolerancePlugin(restart_policy="respawn-rank").setup(_script(), executor)
    monkeypatch.setenv("NVRX_FT_RESTART_POLICY", executor.env_vars["NVRX_FT_RESTART_POLICY"])
    assert build_parser().parse_args(["train.py"]).ft_restart_policy == "respawn-rank"
    assert build_parser().parse_args(["--ft-restart-policy", "any-failed", "train.py"]).ft_restart_policy == "any-failed"


# ---- Partial tasks ------------------------------------------------------------------------

@dataclasses.dataclass
class TrainConfig:
    train_iters: int = 10
    exit_signal_handler: bool = False


@dataclasses.dataclass
class ConfigContainer:
    train: TrainConfig
    ft: object = None
    nvrx_straggler: object = None
    inprocess_restart: object = None


def pretrain(config, forward_step_func=None):
    return config


def fit(trainer, root="."):
    return trainer


def plain(x=1):
    return x


def test_a_megatron_style_partial_gets_nvrx_megatron_configs(tmp_path):
    task = run.Partial(pretrain, config=run.Config(ConfigContainer, train=run.Config(TrainConfig),
                                                   ft=run.Config(FaultToleranceConfig, simulate_fault=True)))
    executor = _executor(tmp_path)
    for plugin in (FaultTolerancePlugin(calc_ft_timeouts=False), PreemptionPlugin(),
                   StragglerDetectionPlugin(config=NVRxStragglerDetectionConfig(report_time_interval=5.0)),
                   InProcessRestartPlugin()):
        plugin.setup(task, executor)
    cfg = fdl.build(task)()
    assert cfg.ft == FaultToleranceConfig(enable_ft_package=True, calc_ft_timeouts=False, simulate_fault=True)
    assert cfg.train.exit_signal_handler is True
    assert cfg.nvrx_straggler.enabled and cfg.nvrx_straggler.report_time_interval == 5.0
    assert cfg.inprocess_restart.enabled
    assert isinstance(executor.launcher, run.FaultTolerance)


def test_a_lightning_partial_gets_callbacks_once(tmp_path):
    task = run.Partial(fit, trainer=run.Config(_Trainer, callbacks=[run.Config(NVRxFaultTolerance)]))
    for _ in range(2):                                        # a second setup adds nothing twice
        for plugin in (FaultTolerancePlugin(), PreemptionPlugin(), StragglerDetectionPlugin()):
            plugin.setup(task, _executor(tmp_path))
    classes = [c.__fn_or_cls__ for c in task.trainer.callbacks]
    assert classes == [NVRxFaultTolerance, NVRxPreemption, NVRxStragglerDetection]
    with pytest.raises(ValueError, match="cannot restart in-process"):
        InProcessRestartPlugin().setup(task, _executor(tmp_path))


class _Trainer:
    def __init__(self, callbacks=None, max_steps=1):
        self.callbacks = callbacks


@pytest.mark.parametrize("plugin", [FaultTolerancePlugin(), PreemptionPlugin(), StragglerDetectionPlugin(),
                                    InProcessRestartPlugin()], ids=lambda p: type(p).__name__)
def test_a_plain_function_partial_is_refused_and_the_executor_left_unchanged(tmp_path, plugin):
    executor = _executor(tmp_path)
    before = repr(executor)
    with pytest.raises(ValueError, match=r"run.Partial\(plain\).*executor was left unchanged"):
        plugin.setup(run.Partial(plain, x=2), executor)
    assert repr(executor) == before and not (tmp_path / "exp" / "job").exists()
    with pytest.raises(TypeError, match="expected a run.Script or run.Partial"):
        plugin.setup(object(), executor)


@dataclasses.dataclass
class BareTrainConfig:
    train_iters: int = 10


def test_a_megatron_config_without_the_handler_field_is_refused_before_the_executor_changes(tmp_path):
    executor = run.SlurmExecutor(account="acct", tunnel=run.LocalTunnel(job_dir=str(tmp_path / "cluster")))
    task = run.Partial(pretrain, config=run.Config(ConfigContainer, train=run.Config(BareTrainConfig)))
    with pytest.raises(ConfigError, match="exit_signal_handler"):
        PreemptionPlugin().setup(task, executor)
    assert executor.signal is None and "NVRX_PREEMPTED_EXIT_CODE" not in executor.env_vars


@pytest.mark.parametrize("fields, message", [
    (dict(num_in_job_restarts=-1), "num_in_job_restarts=-1"),
    (dict(rank_heartbeat_timeout=0), "rank_heartbeat_timeout=0"),
    (dict(calc_ft_timeouts="yes"), "calc_ft_timeouts='yes'"),
    (dict(rank_section_timeouts={"step": -5}), r"rank_section_timeouts\['step'\]=-5"),
    (dict(restart_policy="respawn"), "restart_policy='respawn'"),
])
def test_bad_fault_tolerance_fields_are_named(fields, message):
    with pytest.raises(ConfigError, match=message):
        FaultTolerancePlugin(**fields)


def test_the_config_plugins_take_a_bridge_shaped_config_that_is_not_ours(tmp_path):
    """Bridge's own NVRxStragglerDetectionConfig / InProcessRestartConfig cannot be imported here:
    a namespace with Bridge's field names stands in; the user's object is left as it was."""
    from types import SimpleNamespace

    bridge = SimpleNamespace(enabled=False, report_time_interval=7.0, stop_if_detected=True)
    plugin = StragglerDetectionPlugin(config=bridge)
    assert isinstance(plugin.config, NVRxStragglerDetectionConfig) and plugin.config.enabled
    assert (plugin.config.report_time_interval, plugin.config.stop_if_detected) == (7.0, True)
    assert bridge.enabled is False
    task = _script()
    plugin.setup(task, _executor(tmp_path))
    assert "nvrx_straggler.report_time_interval=7.0" in task.args and "nvrx_straggler.enabled=true" in task.args
    inprocess = InProcessRestartPlugin(config=SimpleNamespace(enabled=False, granularity="rank"))
    assert (inprocess.config.enabled, inprocess.config.granularity) == (True, "rank")
    with pytest.raises(ConfigError, match="StragglerDetectionPlugin.config: .*got list"):
        StragglerDetectionPlugin(config=[7.0])
    with pytest.raises(ConfigError, match="report_time_interval must be positive"):
        StragglerDetectionPlugin(config=SimpleNamespace(report_time_interval=-1.0))


def test_bad_preemption_fields_are_named():
    with pytest.raises(ConfigError, match="preempt_time=0"):
        PreemptionPlugin(preempt_time=0)
    with pytest.raises(ConfigError, match="SIGNOPE"):
        PreemptionPlugin(sig="SIGNOPE")


def test_importable_without_nemo_run_and_setup_names_the_extra():
    code = ("import sys; sys.modules['nemo_run'] = None\n"
            "import nvrx_nemo_run as n\n"
            "p = n.FaultTolerancePlugin(num_in_job_restarts=1)\n"
            "try:\n    p.setup(None, None)\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'nvrx-suite[nemo-run]'" in out.stdout


# ---- a Slurm dry run -----------------------------------------------------------------------

def test_a_slurm_dry_run_writes_an_sbatch_script_our_launcher_accepts(tmp_path, monkeypatch):
    # nemo_run packages through invoke, which mirrors stdin: pytest's captured stdin refuses reads
    stdin = (tmp_path / "stdin").open("w+")
    monkeypatch.setattr(sys, "stdin", stdin)
    executor = run.SlurmExecutor(account="acct", partition="gpu", nodes=1, ntasks_per_node=2, time="01:00:00",
                                 tunnel=run.LocalTunnel(job_dir=str(tmp_path / "cluster")), packager=run.Packager())
    task = run.Script(path="/opt/train.py", args=["--save", "/ckpt"])
    plugins = [FaultTolerancePlugin(rank_section_timeouts={"setup": 600, "step": 60}), PreemptionPlugin()]
    with run.Experiment("dry", executor=executor, base_dir=str(tmp_path / "exp"), log_level="WARN") as exp:
        exp.add(task, name="job", plugins=plugins)
        exp.dryrun(log=False, delete_exp_dir=False)
        script = exp.jobs[0]._dryrun_info.request.materialize()

    assert "#SBATCH --signal=TERM@60" in script
    assert "export NVRX_PREEMPTED_EXIT_CODE=0" in script
    assert not (tmp_path / "cluster").exists()                        # setup wrote nothing on the cluster side
    [cfg_line] = [line for line in script.splitlines() if line.startswith("export NVRX_FT_CONFIG=")]
    value = _exported(cfg_line.split("=", 1)[1])
    [launch] = [line for line in script.splitlines() if " ft_launcher " in line]
    argv = shlex.split(launch.split(" ft_launcher ", 1)[1])
    args = build_parser().parse_args(argv)                   # every flag NeMo-Run wrote is ours too
    assert args.max_restarts == 3 and args.nproc_per_node == "2"
    assert args.training_script == "/opt/train.py"
    assert args.training_script_args == ["--save", "/ckpt", *BRIDGE_FT_ARGS, *BRIDGE_PREEMPTION_ARGS]
    monkeypatch.setenv("NVRX_FT_CONFIG", value)
    [path_line] = [line for line in script.splitlines() if line.startswith("export FAULT_TOL_CFG_PATH=")]
    monkeypatch.setenv("FAULT_TOL_CFG_PATH", path_line.split("=", 1)[1].strip('"'))  # exported, never written
    cfg = load_ft_config(args)
    assert (cfg.initial_rank_heartbeat_timeout, cfg.rank_heartbeat_timeout) == (1800, 300)
    assert cfg.rank_section_timeouts == {"setup": 600, "step": 60}


def test_the_example_dry_runs_a_partial_with_our_launcher(tmp_path):
    form = ["--partial"]
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "nemo_run_ft.py")
    env = dict(os.environ, NEMORUN_HOME=str(tmp_path / "home"), COLUMNS="400")
    out = subprocess.run([sys.executable, example, "--root", str(tmp_path / "root"), "--dryrun", *form],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'ft_launcher'" in out.stdout and "NVRX_FT_CONFIG" in out.stdout
    assert "ft.enable_ft_package=true" not in out.stdout   # a Partial gets a config, not arguments


def _files_under(*roots):
    return {os.path.join(d, n) for root in roots for d, _, names in os.walk(root) for n in names}


def _optional(module, name, **kwargs):
    """An executor whose package is optional in NeMo-Run (Skypilot, Kubernetes): skipped, with the
    reason, where that package is not installed."""
    def make():
        import importlib

        try:
            return getattr(importlib.import_module(f"nemo_run.core.execution.{module}"), name)(**kwargs)
        except (ImportError, AssertionError) as e:  # NeMo-Run asserts Skypilot's presence
            pytest.skip(f"{name} cannot be built here: {e}")
    return make


EXECUTORS = {  # NeMo-Run 0.11's executors, none with a job directory
    "local": lambda: run.LocalExecutor(ntasks_per_node=2),
    "slurm": lambda: run.SlurmExecutor(account="acct", tunnel=run.LocalTunnel(job_dir=""), setup_lines="module load cuda"),
    "docker": lambda: run.DockerExecutor(container_image="nvcr.io/nvidia/pytorch", num_gpus=2),
    "dgxcloud": lambda: run.DGXCloudExecutor(base_url="https://dgx.invalid", kube_apiserver_url="https://k.invalid",
                                             client_id="a", client_secret="s", project_name="p", container_image="img",
                                             pvc_nemo_run_dir="/pvc"),
    "lepton": lambda: run.LeptonExecutor(container_image="img", nemo_run_dir="/nemo_run", nodes=1, gpus_per_node=2),
    "skypilot": _optional("skypilot", "SkypilotExecutor", gpus="H100", gpus_per_node=2),
    "skypilot_jobs": _optional("skypilot_jobs", "SkypilotJobsExecutor", gpus="H100", gpus_per_node=2),
    "kubeflow": _optional("kubeflow", "KubeflowExecutor"),
    "kuberay": _optional("kuberay", "KubeRayExecutor"),
}


@pytest.mark.parametrize("kind", list(EXECUTORS))
def test_setup_on_every_executor_changes_only_the_task_and_the_executor(tmp_path, monkeypatch, kind):
    executor = EXECUTORS[kind]()
    for name in ("run", "put", "get", "connect", "cleanup"):       # no call through any tunnel
        monkeypatch.setattr(run.LocalTunnel, name, lambda *a, **k: pytest.fail("setup used the tunnel"),
                            raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    before = _files_under(tmp_path, os.path.expanduser("~/.nemo_run"))
    task = _script()
    plugins = [FaultTolerancePlugin(rank_section_timeouts={"setup": 600, "step": 60}, rank_out_of_section_timeout=60),
               PreemptionPlugin(), StragglerDetectionPlugin(), InProcessRestartPlugin()]
    for plugin in plugins * 2:                                       # twice: the same outcome
        plugin.setup(task, executor)
    assert _files_under(tmp_path, os.path.expanduser("~/.nemo_run")) == before
    assert isinstance(executor.launcher, run.FaultTolerance)
    assert executor.env_vars["NVRX_FT_CONFIG"] == ("initial_rank_heartbeat_timeout=1800,rank_heartbeat_timeout=300,"
                                                   "rank_section_timeouts.setup=600,rank_section_timeouts.step=60,"
                                                   "rank_out_of_section_timeout=60,workload_check_interval=5.0")
    assert "FAULT_TOL_FINISHED_FLAG_FILE" not in executor.env_vars   # no job directory to put it in
    assert task.args.count(BRIDGE_FT_ARGS[0]) == 2                    # each setup adds its overrides, as Bridge's
    if isinstance(executor, run.SlurmExecutor):
        assert executor.setup_lines == "module load cuda" and executor.signal == "TERM@60"
