"""NVRxFaultTolerance on a real Lightning Trainer: 2-rank CPU DDP fits under a real
ft_launcher (killed, hung and failing ranks, learned timeouts), and in-process fits against
a real node monitor (fit twice, outside ft_launcher, bad input)."""

import json
import os
import shutil

import pytest
import torch

from harness.launcher import SCRIPTS, kinds, run_launcher
from harness.node_monitor import NodeMonitorOnThread
from nvrx_core.config import ConfigError
from nvrx_core.events import read_events
from harness import wait_for

from nvrx_lightning import FaultToleranceCallback, NVRxFaultTolerance, SimulatedFaultParams
from nvrx_lightning._compat import pl

pytestmark = pytest.mark.timeout(300)

JOB = os.path.join(SCRIPTS, "lightning_ft_job.py")
# Learned timeouts are at least 6 s: a loaded 2-core machine must not look like a hang.
LEARNING = ["--ft-safety-factor", "20", "--ft-min-calculated-timeout", "6"]
HEARTBEATS = ["--ft-initial-rank-heartbeat-timeout", "120", "--ft-rank-heartbeat-timeout", "60"]
SECTIONS = ["--ft-rank-section-timeouts", "setup:120,step:60,checkpointing:60",
            "--ft-rank-out-of-section-timeout", "60",
            "--ft-initial-rank-heartbeat-timeout", "None", "--ft-rank-heartbeat-timeout", "None"]
# exception (through the callback) in cycle 0, a killed rank in cycle 1, a hung rank in cycle 2
FAULTS = ["--fault", "rank_exception:1:8:0", "--fault", "rank_killed:1:13:1", "--fault", "rank_hung:0:18:2"]


def fit_under_launcher(root, timeouts, *job_args, max_steps=30, restarts=3):
    root.mkdir(parents=True, exist_ok=True)
    flag = root / "finished.flag"
    result = run_launcher(
        ["--nproc-per-node", "2", "--max-restarts", str(restarts), "--events-file", str(root / "events.jsonl"),
         "--warm-start-preload", "lightning.pytorch,nvrx_lightning",  # as docs/lightning.md advises
         *LEARNING, *timeouts, JOB, "--root", str(root), "--max-steps", str(max_steps), *job_args],
        timeout=280, env={"FAULT_TOL_FINISHED_FLAG_FILE": str(flag)})
    results = [json.loads((root / f"result.rank{r}.json").read_text())
               for r in range(2) if (root / f"result.rank{r}.json").exists()]
    return result, read_events(str(root / "events.jsonl")), results, flag


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A fault-free fit: the weights every recovered fit must end with."""
    root = tmp_path_factory.mktemp("reference")
    result, events, results, flag = fit_under_launcher(root, HEARTBEATS)
    assert result.returncode == 0, result.stdout[-4000:]
    assert [r["global_step"] for r in results] == [30, 30]
    assert results[0]["weights"] == results[1]["weights"]
    assert flag.exists()
    return root, results[0]["weights"]


def check_recovered(result, events, results, flag, reference_weights):
    assert result.returncode == 0, result.stdout[-4000:]
    assert len(kinds(events, "restart_begun")) == 3, [e["kind"] for e in events]
    assert [(r["global_step"], r["cycle"]) for r in results] == [(30, 3), (30, 3)]
    assert all(r["weights"] == reference_weights for r in results)
    assert flag.exists()
    # the flag was written after the last cycle began, never by a failed cycle
    last_start = max(e["time"] for e in kinds(events, "workers_started"))
    assert os.stat(flag).st_mtime >= last_start - 1.0
    # the exception's rank ran no collective on its way out: the job failed at once, not
    # when a timeout noticed a rank stuck with its peer
    [exception] = [e for e in kinds(events, "fault_injected") if e["fault"] == "rank_exception"]
    failed = min(e["time"] for e in kinds(events, "workers_failed") if e["time"] > exception["time"])
    assert failed - exception["time"] < 20
    assert not [e for e in kinds(events, "fault_detected") if e.get("cycle") == 0]


def test_killed_hung_and_failing_ranks_recover_to_the_same_weights_under_heartbeat_timeouts(tmp_path, reference):
    result, events, results, flag = fit_under_launcher(tmp_path / "hb", HEARTBEATS, *FAULTS)
    check_recovered(result, events, results, flag, reference[1])
    assert {e["reason"] for e in kinds(events, "fault_detected")} == {"heartbeat timeout"}


def test_killed_hung_and_failing_ranks_recover_to_the_same_weights_under_section_timeouts(tmp_path, reference):
    result, events, results, flag = fit_under_launcher(tmp_path / "sections", SECTIONS, *FAULTS)
    check_recovered(result, events, results, flag, reference[1])
    hung = [e for e in kinds(events, "fault_detected") if e["cycle"] == 2 and e["rank"] == 0]
    assert hung and hung[0]["reason"] == "section 'step' timeout"
    assert {e["reason"] for e in kinds(events, "fault_detected")} <= {"section 'step' timeout",
                                                                     "out-of-section timeout"}


def test_timeouts_learned_in_one_run_catch_a_hang_in_the_next(tmp_path, reference):
    """Run 1 (the reference) learned timeouts: they are in its state dir and in its checkpoint.
    Run 2 resumes from the checkpoint alone (state file removed) with a launcher allowing 60 s
    between heartbeats; the hang is caught within the learned timeout, not the launcher's 60 s."""
    source, _ = reference
    state = json.loads((source / "ft_state" / "ft_state.json").read_text())
    learned = state["calculated_timeouts"]["heartbeat"]
    assert learned is not None and 6.0 <= learned < 60
    assert state["calculated_timeouts"]["initial_heartbeat"] is None   # run 1 restored nothing
    stored = torch.load(source / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]["NVRxFaultTolerance"]
    assert stored["calculated_timeouts"]["heartbeat"] == pytest.approx(learned)

    root = tmp_path / "run2"
    shutil.copytree(source / "ckpt", root / "ckpt")
    result, events, results, flag = fit_under_launcher(
        root, HEARTBEATS, "--fault", "rank_hung:0:36:0", max_steps=45, restarts=1)
    assert result.returncode == 0, result.stdout[-4000:]
    pushed = [e for e in kinds(events, "timeouts_updated") if e.get("cycle") == 0]
    assert pushed and all(e["timeouts"]["heartbeat"] >= learned - 1e-6 for e in pushed)
    [hang] = kinds(events, "fault_injected")
    detected = [e for e in kinds(events, "fault_detected") if e["rank"] == 0]
    assert detected and detected[0]["reason"] == "heartbeat timeout"
    # far below the launcher's 60 s: the learned timeout caught it (the margin is what a loaded
    # 2-core node adds between the deadline and the monitor's report: 4.4 s seen in a CI run)
    assert detected[0]["time"] - hang["time"] <= learned + 15.0 < 60.0
    assert [r["global_step"] for r in results] == [45, 45]


# ---- in-process fits, devices=1 ---------------------------------------------------------

class TinyModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=4)


def trainer_for(root, callbacks, max_steps):
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, default_root_dir=root,
                      logger=False, enable_progress_bar=False, enable_model_summary=False)


class Watched(pl.Callback):
    """Records, during a fit, whether the monitor is watching this process."""

    def __init__(self, monitor):
        self.monitor = monitor
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(self.monitor.watch(os.getpid()) is not None)


def test_fit_twice_on_one_trainer_connects_and_undoes_everything_each_time(tmp_path, monkeypatch):
    signalled = []
    monitor = NodeMonitorOnThread(tmp_path, send_signal=lambda watch, sig: signalled.append(sig) or True)
    try:
        monkeypatch.setenv("NVRX_FT_MONITOR_SOCKET", monitor.path)
        monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(tmp_path / "finished"))
        ft, watched = NVRxFaultTolerance(), Watched(monitor)
        checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True)
        trainer = trainer_for(tmp_path, [ft, watched, checkpoints], max_steps=6)
        model = TinyModel()
        plain_save = trainer.save_checkpoint
        for max_steps in (6, 12):
            trainer.fit_loop.epoch_loop.max_steps = max_steps
            trainer.fit(model)
            assert trainer.global_step == max_steps
            assert "save_checkpoint" not in vars(trainer) and trainer.save_checkpoint == plain_save
            wait_for(lambda: monitor.watch(os.getpid()) is None, what="goodbye")   # not watched any more
            assert watched.seen and all(watched.seen)
            watched.seen.clear()
        assert signalled == []
        assert (tmp_path / "finished").exists()
        state = json.loads((tmp_path / "ft_state" / "ft_state.json").read_text())
        assert state["calculated_timeouts"]["heartbeat"] is not None
    finally:
        monitor.close()


def test_a_new_run_uses_the_timeouts_the_state_dir_kept(tmp_path, monkeypatch):
    """Run 1 learns and writes ft_state.json; run 2 (a new Trainer, no checkpoint) pushes
    them to the monitor at setup, before its first step."""
    monitor = NodeMonitorOnThread(tmp_path, send_signal=lambda watch, sig: True)
    try:
        monkeypatch.setenv("NVRX_FT_MONITOR_SOCKET", monitor.path)
        checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)
        trainer_for(tmp_path, [NVRxFaultTolerance(), checkpoints], max_steps=6).fit(TinyModel())
        learned = json.loads((tmp_path / "ft_state" / "ft_state.json").read_text())["calculated_timeouts"]
        assert learned["heartbeat"] is not None

        class Enforced(pl.Callback):
            def on_train_start(self, trainer, pl_module):
                watch = monitor.watch(os.getpid())
                wait_for(lambda: watch.timeouts.heartbeat == pytest.approx(learned["heartbeat"]),
                         what="the learned heartbeat timeout enforced before the first step")
                self.checked = True
        enforced = Enforced()
        trainer_for(tmp_path, [NVRxFaultTolerance(), enforced], max_steps=2).fit(TinyModel())
        assert enforced.checked
    finally:
        monitor.close()


def test_outside_ft_launcher_it_says_so_once_and_does_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("NVRX_FT_MONITOR_SOCKET", raising=False)
    monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(tmp_path / "finished"))
    trainer = trainer_for(tmp_path, [NVRxFaultTolerance()], max_steps=3)
    with caplog.at_level("WARNING", logger="nvrx.ft.client"):
        trainer.fit(TinyModel())
    assert caplog.text.count("monitoring is INACTIVE") == 1
    assert not (tmp_path / "finished").exists() and not (tmp_path / "ft_state" / "ft_state.json").exists()


def test_bad_arguments_are_refused_naming_them(tmp_path):
    with pytest.raises(ConfigError, match="fault_type='sideways'"):
        NVRxFaultTolerance(simulated_fault={"fault_type": "sideways", "at_iteration": 3})
    with pytest.raises(ConfigError, match="base_delay=-1"):
        FaultToleranceCallback(True, True, simulated_fault_params=SimulatedFaultParams("rank_killed", base_delay=-1))
    with pytest.raises(ConfigError, match="simulated_fault_params=\\['when'\\]"):
        FaultToleranceCallback(True, True,
                               simulated_fault_params={"fault_type": "rank_hung", "base_delay": 1, "when": 2})
    with pytest.raises(ConfigError, match="calculate_timeouts"):
        NVRxFaultTolerance(calculate_timeouts="yes")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    trainer = trainer_for(tmp_path, [NVRxFaultTolerance(state_dir=blocker / "state")], max_steps=1)
    with pytest.raises(ConfigError, match="state_dir=.*a_file/state.*cannot write there"):
        trainer.fit(TinyModel())


def test_ported_callback_takes_nvidia_resiliency_ext_argument_names(tmp_path):
    ported = FaultToleranceCallback(autoresume=False, calculate_timeouts=True, exp_dir=tmp_path,
                                    simulated_fault_params={"fault_type": "rank_killed", "base_delay": 5,
                                                            "rand_delay": 1, "rank_to_fail": 1})
    assert isinstance(ported, NVRxFaultTolerance)
    assert ported.state_dir == str(tmp_path) and ported.write_finished_flag is False
    fault = ported.simulated_fault
    assert (fault.fault_type, fault.base_delay, fault.jitter, fault.rank_to_fail) == ("rank_killed", 5, 1, 1)


def test_the_lightning_example_runs_under_ft_launcher_with_every_part_on(tmp_path):
    example = os.path.join(os.path.dirname(SCRIPTS), os.pardir, "examples", "lightning_ft.py")
    result = run_launcher(["--nproc-per-node", "2", "--max-restarts", "0",
                           "--warm-start-preload", "lightning.pytorch,nvrx_lightning",
                           os.path.abspath(example), "--root", str(tmp_path), "--max-steps", "120"], timeout=280)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "`Trainer.fit` stopped: `max_steps=120` reached" in result.stdout
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert (tmp_path / "ft_state" / "ft_state.json").exists()     # learned at the end of the fit
