"""NVRxPreemption in real Hugging Face Trainer runs on CPU.

A two-rank gloo job under ft_launcher (tests/scripts/hf_preempt_job.py) gets SIGTERM on
rank 1 only: both ranks agree at the same global step, the Trainer writes checkpoint-<step>
with every rank's share, and the launcher exits 18. A job resumed from it with
`train(resume_from_checkpoint=True)` ends with the weights of a run that was never
interrupted (computed once per module). The single-process tests run the Trainer in this
process (no torch.distributed).

The fault-free and resumed jobs are started by the test itself, as torchrun would start
them, from a process that preloaded transformers (tests/warm_python.py), so the suite pays
transformers' import once for them.
"""

import json
import os
import signal
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before the warm servers import transformers: nothing is fetched

import pytest
import torch
import torch.distributed as dist

from harness.launcher import SCRIPTS, kill_tree, kinds, warm_popen
from harness.ranks import TorchrunLikeRanks, tail
from harness import wait_for
import warm_python
from nvrx_core.config import ConfigError
from nvrx_core.events import read_events
from nvrx_core.exit_codes import ExitCode
from nvrx_core.signals import SignalClaimError, default_registry

sys.path.insert(0, SCRIPTS)
import hf_tiny  # noqa: E402  (imports transformers)

from nvrx_hf import NVRxPreemption  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

JOB = os.path.join(SCRIPTS, "hf_preempt_job.py")
HF_PRELOAD = (*warm_python.TORCH, "transformers.trainer", "nvrx_hf")
MAX_STEPS, CHECK_EVERY = 40, 4
SIGNALLED_AT = 6
# The run to be signalled: rank 1 waits at step 6 until its SIGTERM has arrived (before: the
# pacing alone, >= 4 s of training, which a test thread stalled as long outlasted).
PACED = ("--pace-s", "0.1", "--wait-for-sigterm-at", str(SIGNALLED_AT))
PREEMPTED = int(ExitCode.PREEMPTED)


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVRX_", "FAULT_TOL_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **extra)
    return env


def Ranks(out, *args):
    """Two ranks of hf_preempt_job.py started by the test, as torchrun would."""
    return TorchrunLikeRanks(out, [JOB, "--out", out, "--max-steps", str(MAX_STEPS), "--check-every", str(CHECK_EVERY),
                                   *args], preload=HF_PRELOAD, env={"HF_HUB_OFFLINE": "1"})


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def wait_or_fail(condition, timeout, what, logs):
    try:
        wait_for(condition, timeout, what)
    except AssertionError as e:
        pytest.fail(f"{e}\n{logs()}")


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """The weights of an uninterrupted 2-rank run: what a resumed run must end with."""
    out = str(tmp_path_factory.mktemp("fault_free"))
    ranks = Ranks(out)
    assert ranks.finish() == [0, 0], ranks.logs()
    return [torch.load(os.path.join(out, f"final.rank{r}.pt")) for r in range(2)]


# ---- multi-rank ---------------------------------------------------------------------------

@pytest.mark.timeout(420)
def test_sigterm_to_rank_1_under_ft_launcher_stops_every_rank_at_one_step_exits_18_and_resumes_exactly(
        tmp_path, fault_free):
    run1, run2, events_file = str(tmp_path / "run1"), str(tmp_path / "run2"), str(tmp_path / "events.jsonl")
    os.makedirs(run1)
    log_path = str(tmp_path / "launcher.log")
    with open(log_path, "w") as log:
        launcher = warm_popen(
            [sys.executable, "-m", "nvrx_core.ft.command", "--nproc-per-node", "2", "--max-restarts", "1",
             "--events-file", events_file, "--warm-start-preload", "transformers.trainer,nvrx_hf",
             JOB, "--out", run1, "--max-steps", str(MAX_STEPS), "--check-every", str(CHECK_EVERY), *PACED],
            env=clean_env(), stdout=log, stderr=warm_python.STDOUT, start_new_session=True)
    try:
        progress = lambda: read_json(os.path.join(run1, "progress.rank1")) or {}  # noqa: E731
        wait_or_fail(lambda: progress().get("step", -1) >= SIGNALLED_AT, 200, "both ranks training", lambda: tail(log_path))
        os.kill(progress()["pid"], signal.SIGTERM)           # only rank 1 is told
        launcher.wait(timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ft_launcher did not exit after the stop\n{tail(log_path)}")
    finally:
        kill_tree(launcher.pid)
        launcher.wait()
    assert launcher.returncode == PREEMPTED, tail(log_path)

    events = read_events(events_file)
    assert not kinds(events, "restart_begun")               # preempted: requeue, not restart in place
    agreed = {e["rank"]: e["step"] for e in kinds(events, "preemption_agreed")}
    assert set(agreed) == {0, 1} and len(set(agreed.values())) == 1, agreed
    stopped = agreed[0]
    assert stopped % CHECK_EVERY == 0 and SIGNALLED_AT <= stopped < MAX_STEPS, stopped
    # Written by each rank in its on_save, before the barrier that precedes any exit.
    saved = [read_json(os.path.join(run1, f"saved.rank{r}.json")) for r in range(2)]
    assert [s["step"] for s in saved] == [stopped, stopped], saved
    assert [s["signals"] for s in saved] == [[], ["SIGTERM"]]    # rank 0 learnt it by agreement
    checkpoint = os.path.join(run1, f"checkpoint-{stopped}")
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "trainer_state.json"} <= set(os.listdir(checkpoint))
    assert read_json(os.path.join(checkpoint, "trainer_state.json"))["global_step"] == stopped
    # The first rank to exit 18 ends the cycle and the agent stops the other, which may be
    # killed before its result is written; a result that exists says 18 and a restored handler.
    results = [r for r in (read_json(os.path.join(run1, f"result.rank{r}.json")) for r in range(2)) if r]
    assert results and all(r["exit"] == PREEMPTED and r["global_step"] == stopped and r["handler_restored"]
                           for r in results), results

    resumed = Ranks(run2, "--resume", "--output-dir", run1)
    assert resumed.finish() == [0, 0], resumed.logs()
    assert [read_json(os.path.join(run2, f"result.rank{r}.json"))["start_step"] for r in range(2)] == [stopped] * 2
    for rank in range(2):
        expected, actual = fault_free[rank], torch.load(os.path.join(run2, f"final.rank{rank}.pt"))
        assert expected.keys() == actual.keys()
        assert all(torch.equal(expected[k], actual[k]) for k in expected), f"rank {rank}: weights differ"


# ---- single process (no torch.distributed) --------------------------------------------------

class SignalAt(TrainerCallback):
    """Sends `signum` to this process at the end of global step `step`."""

    def __init__(self, signum, step):
        self.signum, self.step = signum, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.timeout(180)
def test_one_process_signal_stops_saves_exits_and_a_second_train_resumes(tmp_path):
    assert not dist.is_initialized()
    watched = (signal.SIGTERM, signal.SIGUSR1)
    before = {s: signal.getsignal(s) for s in watched}
    preemption = NVRxPreemption(signals=["SIGUSR1"], check_every_n_steps=3, exit_code=143)
    sender = SignalAt(signal.SIGUSR1, 4)
    trainer = Trainer(model=hf_tiny.tiny_model(), args=hf_tiny.training_args(str(tmp_path), 12),
                      train_dataset=hf_tiny.Tokens(256), callbacks=[sender, preemption])
    with pytest.raises(SystemExit) as stop:
        trainer.train()
    assert stop.value.code == 143
    assert preemption.stopped_at_step == 6 and trainer.state.global_step == 6   # the first check after the signal
    assert preemption.received == [signal.SIGUSR1]
    assert {s: signal.getsignal(s) for s in watched} == before
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-6"]
    assert read_json(str(tmp_path / "checkpoint-6" / "trainer_state.json"))["global_step"] == 6

    sender.step = -1                              # the same Trainer again, from the checkpoint, no signal
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 12 and preemption.stopped_at_step is None and preemption.received == []
    assert {s: signal.getsignal(s) for s in watched} == before
    assert default_registry().owner(signal.SIGUSR1) is None


@pytest.mark.timeout(120)
def test_a_signal_held_by_another_part_is_refused_naming_both_owners(tmp_path):
    before = signal.getsignal(signal.SIGUSR2)
    claim = default_registry().claim(signal.SIGUSR2, "in-process restart", lambda *a: None)
    try:
        trainer = Trainer(model=hf_tiny.tiny_model(), args=hf_tiny.training_args(str(tmp_path), 3),
                          train_dataset=hf_tiny.Tokens(64), callbacks=[NVRxPreemption(signals=[signal.SIGUSR2])])
        with pytest.raises(SignalClaimError, match="preemption cannot claim SIGUSR2: it is held by in-process restart"):
            trainer.train()
    finally:
        claim.release()
    assert signal.getsignal(signal.SIGUSR2) == before


@pytest.mark.parametrize("kwargs,match", [
    ({"signals": ["SIGKILL"]}, "signals='SIGKILL': cannot be caught"),
    ({"signals": ["SIGNOPE"]}, "signals='SIGNOPE': is not a signal name"),
    ({"signals": []}, "signals=\\[\\]: must be a non-empty list"),
    ({"check_every_n_steps": 0}, "check_every_n_steps=0: must be an integer >= 1"),
    ({"exit_code": 0}, "exit_code=0: must be an integer in 1..255"),
])
def test_bad_arguments_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        NVRxPreemption(**kwargs)


def test_signals_by_name_number_or_alone():
    assert NVRxPreemption().config.signals == ["SIGTERM"]
    assert NVRxPreemption(signals="SIGUSR1").config.signals == ["SIGUSR1"]
    assert NVRxPreemption(signals=[signal.SIGUSR2, "SIGTERM"]).config.signals == ["SIGUSR2", "SIGTERM"]
    assert NVRxPreemption().config.exit_code == PREEMPTED and NVRxPreemption().config.check_every_n_steps == 10
