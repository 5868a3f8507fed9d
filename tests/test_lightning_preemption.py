"""NVRxPreemption in real Lightning fits on CPU.

Two-rank DDP jobs (tests/scripts/lightning_preempt_job.py) get SIGTERM on rank 1 only:
every rank stops at the same agreed global step, the checkpoint is saved, each process
exits 18, and so does ft_launcher; a job resumed from that checkpoint with
`fit(ckpt_path="last")` ends with the weights of a run that was never interrupted. The
single-process tests run the Trainer in this process (devices=1, no torch.distributed).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from harness.launcher import SCRIPTS, kill_tree, kinds
from harness import wait_for
from harness.ranks import TorchrunLikeRanks
import warm_python
from nvrx_core.config import ConfigError
from nvrx_core.events import read_events
from nvrx_core.exit_codes import ExitCode
from nvrx_core.signals import SignalClaimError, default_registry

sys.path.insert(0, SCRIPTS)
import lightning_preempt_job as job  # noqa: E402  (imports Lightning)

from nvrx_lightning._compat import Callback  # noqa: E402
from nvrx_lightning.preemption import NVRxPreemption  # noqa: E402

JOB = os.path.join(SCRIPTS, "lightning_preempt_job.py")
MAX_STEPS, CHECK_EVERY = 100, 4
SIGNALLED_AT = 6
# A run to be signalled: rank 1 waits at step 6 until its SIGTERM has arrived (before: the
# pacing alone, >= 3 s of training, which a test thread stalled as long outlasted).
PACED = ("--pace-s", "0.03", "--wait-for-sigterm-at", str(SIGNALLED_AT))
PREEMPTED = int(ExitCode.PREEMPTED)


# ---- helpers: a job whose ranks this test starts itself, as torchrun would ----------------

def Job(out, *args):
    """Two ranks of the Lightning job started by the test, as torchrun would."""
    return TorchrunLikeRanks(out, [JOB, "--out", out, "--max-steps", str(MAX_STEPS), "--check-every", str(CHECK_EVERY),
                                   "--pace-s", "0", *args], preload=warm_python.LIGHTNING)


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def progress(out, rank):
    return read_json(os.path.join(out, f"progress.rank{rank}")) or {}


def result(out, rank):
    return read_json(os.path.join(out, f"result.rank{rank}.json"))


def load_checkpoint(path):
    return torch.load(path, map_location="cpu", weights_only=False)


# ---- multi-rank ---------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_sigterm_to_rank_1_stops_every_rank_at_one_step_exits_18_and_resumes_to_identical_weights(tmp_path):
    run1, reference, run2 = (str(tmp_path / name) for name in ("run1", "reference", "run2"))
    uninterrupted = Job(reference)               # alongside run 1: both pay Lightning's import at once
    interrupted = Job(run1, *PACED)
    try:
        wait_for(lambda: progress(run1, 1).get("step", -1) >= SIGNALLED_AT, 150, "run 1 training",
                 details=interrupted.logs)
        interrupted.procs[1].send_signal(signal.SIGTERM)   # only rank 1 is told
        codes = interrupted.finish()
        assert codes == [PREEMPTED, PREEMPTED], interrupted.logs()
        assert uninterrupted.finish() == [0, 0], uninterrupted.logs()
    finally:
        interrupted.kill()
        uninterrupted.kill()
    results = [result(run1, r) for r in range(2)]
    stopped = results[0]["stopped_at"]
    assert [r["stopped_at"] for r in results] == [stopped, stopped]
    assert [r["global_step"] for r in results] == [stopped, stopped]
    assert stopped % CHECK_EVERY == 0 and stopped >= SIGNALLED_AT
    assert stopped < MAX_STEPS, "the job finished before the signal arrived: the test is void"
    assert [r["exit"] for r in results] == [PREEMPTED, PREEMPTED]
    assert [r["signals"] for r in results] == [[], ["SIGTERM"]]     # rank 0 learnt it by agreement
    assert all(r["handler_restored"] for r in results)             # SIGTERM's handler is the one from before fit
    saved = os.path.join(run1, "ckpt", f"last-preempted-step={stopped}.ckpt")
    assert load_checkpoint(saved)["global_step"] == stopped

    resumed = Job(run2, "--resume", "--ckpt-dir", os.path.join(run1, "ckpt"))
    assert resumed.finish() == [0, 0], resumed.logs()
    assert [result(run2, r)["start_step"] for r in range(2)] == [stopped, stopped]
    for rank in range(2):
        expected = torch.load(os.path.join(reference, f"final.rank{rank}.pt"))
        actual = torch.load(os.path.join(run2, f"final.rank{rank}.pt"))
        assert expected.keys() == actual.keys()
        assert all(torch.equal(expected[k], actual[k]) for k in expected), f"rank {rank}: weights differ"


@pytest.mark.timeout(240)
def test_under_ft_launcher_sigterm_to_one_worker_makes_the_launcher_exit_18(tmp_path):
    out, events_file = str(tmp_path), str(tmp_path / "events.jsonl")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVRX_", "FAULT_TOL_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "nvrx_core.ft.command", "--nproc-per-node", "2", "--max-restarts", "1",
         "--events-file", events_file, "--warm-start-preload", "lightning.pytorch,nvrx_lightning",
         JOB, "--out", out, "--max-steps", str(MAX_STEPS),
         "--check-every", str(CHECK_EVERY), *PACED],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    output = ""
    try:
        wait_for(lambda: progress(out, 1).get("step", -1) >= SIGNALLED_AT, 150, "both workers training")
        os.kill(progress(out, 1)["pid"], signal.SIGTERM)
        output, _ = launcher.communicate(timeout=150)
    finally:
        kill_tree(launcher.pid)
        if launcher.poll() is None:
            output += launcher.communicate()[0]
    assert launcher.returncode == PREEMPTED, output[-4000:]
    events = read_events(events_file)
    assert not kinds(events, "restart_begun")          # preempted: requeue, not restart in place
    assert {e["rank"] for e in kinds(events, "preemption_agreed")} == {0, 1}
    # The first rank to exit 18 ends the cycle; the agent stops the other, which may already
    # be past its exit's last Python code (18), be killed by that SIGTERM (-15), or still be
    # running when the agent polls (listed as stopped, no code). Loaded CI runs saw the last
    # two before the rank wrote its result; a rank without a result is one of those.
    [failed] = kinds(events, "workers_failed")
    codes = {int(rank): code for rank, code in failed["exit_codes"].items()}
    assert PREEMPTED in codes.values() and set(codes.values()) <= {PREEMPTED, -signal.SIGTERM}, failed
    stopped = set(failed["stopped_ranks"]) | {rank for rank, code in codes.items() if code == -signal.SIGTERM}
    by_rank = {rank: result(out, rank) for rank in range(2)}
    assert all(r is not None or rank in stopped for rank, r in by_rank.items()), (by_rank, failed, output[-4000:])
    results = [r for r in by_rank.values() if r is not None]
    assert results and all(r["exit"] == PREEMPTED for r in results), (results, output[-4000:])
    assert len({r["stopped_at"] for r in results}) == 1 and results[0]["stopped_at"] < MAX_STEPS, results


# ---- single process (devices=1, no torch.distributed) -------------------------------------

class SignalAt(Callback):
    """Sends `signum` to this process at the end of the batch that reaches global step `step`."""

    def __init__(self, signum, step):
        self.signum, self.step = signum, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.timeout(120)
def test_one_process_signal_stops_saves_exits_and_a_second_fit_resumes(tmp_path):
    assert not dist.is_initialized()
    watched = (signal.SIGTERM, signal.SIGUSR1)
    before = {s: signal.getsignal(s) for s in watched}
    preemption = NVRxPreemption(signals=["SIGUSR1"], check_every_n_steps=3, exit_code=143,
                                dirpath=tmp_path / "stop")
    sender = SignalAt(signal.SIGUSR1, 4)
    trainer = job.make_trainer(str(tmp_path), 1, 12, [sender, preemption])
    model = job.StepSeededNet()
    with pytest.raises(SystemExit) as stop:
        trainer.fit(model)
    assert stop.value.code == 143
    assert preemption.stopped_at_step == 6 and trainer.global_step == 6   # the first check after the signal
    assert preemption.received == [signal.SIGUSR1]
    assert {s: signal.getsignal(s) for s in watched} == before
    saved = str(tmp_path / "stop" / "last-preempted-step=6.ckpt")
    assert load_checkpoint(saved)["global_step"] == 6

    sender.step = -1                              # the same Trainer again, from the checkpoint, no signal
    trainer.fit(model, ckpt_path=saved)
    assert trainer.global_step == 12 and preemption.stopped_at_step is None and preemption.received == []
    assert {s: signal.getsignal(s) for s in watched} == before
    assert default_registry().owner(signal.SIGUSR1) is None


@pytest.mark.timeout(120)
def test_a_signal_held_by_another_part_is_refused_naming_both_owners(tmp_path):
    before = signal.getsignal(signal.SIGUSR2)
    claim = default_registry().claim(signal.SIGUSR2, "in-process restart", lambda *a: None)
    try:
        trainer = job.make_trainer(str(tmp_path), 1, 3, [NVRxPreemption(signals=[signal.SIGUSR2])])
        with pytest.raises(SignalClaimError, match="preemption cannot claim SIGUSR2: it is held by in-process restart"):
            trainer.fit(job.StepSeededNet())
    finally:
        claim.release()
    assert signal.getsignal(signal.SIGUSR2) == before


@pytest.mark.parametrize("kwargs,match", [
    ({"signals": ["SIGKILL"]}, "signals='SIGKILL': cannot be caught"),
    ({"signals": ["SIGNOPE"]}, "signals='SIGNOPE': is not a signal name"),
    ({"check_every_n_steps": 0}, "check_every_n_steps=0: must be an integer >= 1"),
    ({"exit_code": 0}, "exit_code=0: must be an integer in 1..255"),
    ({"dirpath": 5}, "dirpath=5: must be a directory path or None"),
])
def test_bad_arguments_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        NVRxPreemption(**kwargs)


def test_signals_by_name_number_or_alone():
    assert NVRxPreemption().config.signals == ["SIGTERM"]
    assert NVRxPreemption(signals="SIGUSR1").config.signals == ["SIGUSR1"]
    assert NVRxPreemption(signals=[signal.SIGUSR2, "SIGTERM"]).config.signals == ["SIGUSR2", "SIGTERM"]
    assert NVRxPreemption().config.exit_code == PREEMPTED and NVRxPreemption().config.check_every_n_steps == 10


class SlowIO(job.pl.plugins.TorchCheckpointIO):
    """Writes after a pause, so an asynchronous save is still in flight for a while."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        time.sleep(0.5)
        super().save_checkpoint(checkpoint, path, storage_options)


class SeenOnException(Callback):
    def __init__(self):
        self.files = None

    def on_exception(self, trainer, pl_module, exception):
        self.files = sorted(os.listdir(trainer.default_root_dir + "/stop"))


@pytest.mark.timeout(120)
def test_an_asynchronous_save_is_written_before_the_exit_begins(tmp_path):
    preemption = NVRxPreemption(signals=["SIGUSR1"], check_every_n_steps=2, dirpath=tmp_path / "stop")
    seen = SeenOnException()
    trainer = job.make_trainer(str(tmp_path), 1, 12, [SignalAt(signal.SIGUSR1, 1), preemption, seen])
    trainer.strategy.checkpoint_io = job.pl.plugins.io.AsyncCheckpointIO(SlowIO())
    with pytest.raises(SystemExit) as stop:
        trainer.fit(job.StepSeededNet())
    assert stop.value.code == PREEMPTED
    assert seen.files == ["last-preempted-step=2.ckpt"]   # already there when on_exception ran
