"""`run.run`-style jobs on a real NeMo-Run LocalExecutor with 2 ranks: FaultTolerancePlugin makes
NeMo-Run start our ft_launcher, a rank hung (run.Script of the Megatron-style trainer, under
section timeouts) or killed (run.Partial of it, and of the Lightning example) once is restarted
in place, and the job ends with the weights of a fault-free run."""

import json
import os
import sys

import pytest

nemo_run = pytest.importorskip("nemo_run")
run = nemo_run

from harness.launcher import REPO, kinds  # noqa: E402
from megatron_trainer import ITERS, STEP_TIME, shared_reference_weights  # noqa: E402
from nvrx_core.events import read_events  # noqa: E402
from nvrx_nemo_run import FaultTolerancePlugin  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MEGATRON_DIR = os.path.join(REPO, "examples", "megatron_style")
TRAINER = os.path.join(MEGATRON_DIR, "pretrain_gpt.py")
EXAMPLES = os.path.join(REPO, "examples")
# Short enough to be caught in a test, long enough for a loaded 2-core machine.
PLUGIN = dict(num_in_job_restarts=2, initial_rank_heartbeat_timeout=120, rank_heartbeat_timeout=20)


def run_job(root, task, plugins, pythonpath=()):
    """The task on LocalExecutor(ntasks_per_node=2) in an Experiment under `root`: (job, results, events, flag);
    job.task is the experiment's copy, which the plugins changed."""
    root.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),  # our ft_launcher
           "OMP_NUM_THREADS": "1", "NVRX_EVENTS_FILE": str(root / "events.jsonl"),
           "PYTHONPATH": os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")])}
    executor = run.LocalExecutor(ntasks_per_node=2, env_vars=env)
    with run.Experiment("nvrx", executor=executor, base_dir=str(root / "exp"), log_level="WARN") as exp:
        exp.add(task, name="job", plugins=plugins)
        exp.run(sequential=True)
    job = exp.jobs[0]
    results = [json.loads((root / "results" / f"result{r}.json").read_text())
               for r in range(2) if (root / "results" / f"result{r}.json").exists()]
    flag = os.path.join(job.executor.job_dir, "finished_flag")
    return job, results, read_events(str(root / "events.jsonl")), flag


def check_restarted_once_to(weights, job, results, events, flag, steps_key="iteration", steps=ITERS,
                            fault="rank_killed"):
    assert str(job.state) == "SUCCEEDED", job.state
    assert [e["fault"] for e in kinds(events, "fault_injected")] == [fault]
    assert len(kinds(events, "restart_begun")) == 1 and kinds(events, "launcher_exit")[0]["exit_code"] == 0
    assert [(r[steps_key], r["cycle"]) for r in results] == [(steps, 1)] * 2
    assert all(r["weights"] == weights for r in results)
    assert os.path.exists(flag)                                 # the plugin's finished flag, written by the job


@pytest.fixture(scope="module")
def megatron_weights(tmp_path_factory):
    return shared_reference_weights(tmp_path_factory)


def test_a_script_of_the_megatron_style_trainer_hung_under_section_timeouts(tmp_path, megatron_weights):
    """Section timeouts exist only in the plugin's NVRX_FT_CONFIG (NeMo-Run's command line has no
    flag for them): the hang is caught by one of them, heartbeats being off."""
    task = run.Script(path=TRAINER, entrypoint="python",
                      args=["--save", str(tmp_path / "ckpt"), "--train-iters", str(ITERS), "--step-time", STEP_TIME,
                            "--simulated-fault", "rank_hung:1:3", "--result-dir", str(tmp_path / "results")])
    sections = dict(PLUGIN, initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None,
                    rank_section_timeouts={"setup": 120, "step": 15, "checkpointing": 60}, rank_out_of_section_timeout=15)
    outcome = run_job(tmp_path, task, [FaultTolerancePlugin(**sections)])
    check_restarted_once_to(megatron_weights, *outcome, fault="rank_hung")
    reasons = {e["reason"] for e in kinds(outcome[2], "fault_detected")}
    assert reasons and reasons <= {"section 'step' timeout", "section 'checkpointing' timeout",
                                   "out-of-section timeout"}, reasons
    assert outcome[0].task.args[-2:] == ["ft.enable_ft_package=true", "ft.calc_ft_timeouts=true"]


def test_a_partial_of_the_megatron_style_trainer(tmp_path, megatron_weights):
    sys.path.insert(0, MEGATRON_DIR)
    try:
        import bridge_style
        import pretrain_gpt
        from nvrx_megatron import FaultToleranceConfig
    finally:
        sys.path.remove(MEGATRON_DIR)
    cfg = run.Config(
        bridge_style.ConfigContainer,
        train=run.Config(bridge_style.TrainConfig, train_iters=ITERS),
        checkpoint=run.Config(bridge_style.CheckpointConfig, save=str(tmp_path / "ckpt")),
        ft=run.Config(FaultToleranceConfig, simulate_fault=True, simulated_fault_type="rank_killed",
                      simulated_fault_rank=1, simulated_fault_base_delay=3))
    task = run.Partial(pretrain_gpt.pretrain_tiny_gpt, cfg=cfg, step_time=float(STEP_TIME),
                       result_dir=str(tmp_path / "results"))
    outcome = run_job(tmp_path, task, [FaultTolerancePlugin(**PLUGIN)], pythonpath=[MEGATRON_DIR])
    check_restarted_once_to(megatron_weights, *outcome)
    assert outcome[0].task.cfg.ft.enable_ft_package is True      # set by the plugin, the fault kept


def _lightning_partial(root, kill_at=None):
    sys.path.insert(0, EXAMPLES)
    try:
        import lightning_ft
        from nvrx_lightning._compat import pl
    finally:
        sys.path.remove(EXAMPLES)
    trainer = run.Config(
        pl.Trainer, accelerator="cpu", devices=2, strategy="ddp", max_steps=60, default_root_dir=str(root),
        enable_progress_bar=False, logger=False,
        callbacks=[run.Config(pl.callbacks.ModelCheckpoint, dirpath=str(root / "checkpoints"), save_last=True,
                              every_n_train_steps=10)])
    return run.Partial(lightning_ft.fit, trainer=trainer, root=str(root), kill_at=kill_at,
                       result_dir=str(root / "results"))


def test_a_partial_of_the_lightning_example(tmp_path):
    from nvrx_lightning import NVRxFaultTolerance

    reference = run_job(tmp_path / "reference", _lightning_partial(tmp_path / "reference"),
                        [FaultTolerancePlugin(**PLUGIN)], pythonpath=[EXAMPLES])
    assert str(reference[0].state) == "SUCCEEDED" and [r["global_step"] for r in reference[1]] == [60, 60]
    outcome = run_job(tmp_path / "faulty", _lightning_partial(tmp_path / "faulty", kill_at="1:25"),
                      [FaultTolerancePlugin(**PLUGIN)], pythonpath=[EXAMPLES])
    check_restarted_once_to(reference[1][0]["weights"], *outcome, steps_key="global_step", steps=60)
    assert [c.__fn_or_cls__ for c in outcome[0].task.trainer.callbacks][-1] is NVRxFaultTolerance
