"""Running the reference Bridge-style trainer (examples/megatron_style/pretrain_gpt.py) under a
real ft_launcher with 2 gloo ranks, and what its jobs must end with."""

import fcntl
import json
import os

import torch

from harness.launcher import REPO, SCRIPTS, kinds, run_launcher
from nvrx_core.durable import atomic_write_json
from nvrx_core.events import read_events
from nvrx_core.report.goodput import goodput
from nvrx_core.report.incidents import find_incidents

TRAINER = os.path.join(REPO, "examples", "megatron_style", "pretrain_gpt.py")
RECORDED_TRAINER = os.path.join(SCRIPTS, "megatron_recorded_time.py")
"""The same trainer and flags, its straggler manager on a recorded timeline (the script's docstring)."""
ITERS = 200
STEP_TIME = "0.03"  # 200 steps of 30 ms: the training loop alone outlasts the 5 s timeouts
# Start-up (imports, gloo) is covered by the generous first timeouts; the job's own pace by 5 s ones.
HEARTBEATS = ["--ft-initial-rank-heartbeat-timeout", "120", "--ft-rank-heartbeat-timeout", "5"]
SECTIONS = ["--ft-rank-section-timeouts", "setup:120,step:5,checkpointing:30",
            "--ft-rank-out-of-section-timeout", "5",
            "--ft-initial-rank-heartbeat-timeout", "None", "--ft-rank-heartbeat-timeout", "None"]
TIMEOUTS = {"heartbeats": HEARTBEATS, "sections": SECTIONS}
ALL_ON = ["--straggler", "--rerun-mode", "validate_results", "--exit-signal-handler"]


def train(root, timeouts, *trainer_args, iters=ITERS, restarts=1, launcher_args=(), trainer=TRAINER):
    """One job of the trainer under ft_launcher: (launcher result, events, per-rank results, flag).
    `trainer`: TRAINER, or RECORDED_TRAINER for a straggler ranking decided on recorded time."""
    root.mkdir(parents=True, exist_ok=True)
    flag = root / "finished.flag"
    result = run_launcher(
        ["--nproc-per-node", "2", "--max-restarts", str(restarts), "--events-file", str(root / "events.jsonl"),
         *timeouts, *launcher_args, trainer, "--save", str(root / "ckpt"), "--train-iters", str(iters), "--step-time", STEP_TIME,
         "--enable-ft", "--result-dir", str(root), *trainer_args],
        timeout=300, env={"FAULT_TOL_FINISHED_FLAG_FILE": str(flag)})
    results = [json.loads((root / f"result{r}.json").read_text())
               for r in range(2) if (root / f"result{r}.json").exists()]
    return result, read_events(str(root / "events.jsonl")), results, flag


def saved_iteration(root) -> int:
    return torch.load(root / "ckpt" / "checkpoint.pt", weights_only=False)["iteration"]


def reference_weights(root):
    """A fault-free job under the short heartbeat timeouts (nothing is falsely killed): its weights."""
    result, events, results, flag = train(root, HEARTBEATS)
    assert result.returncode == 0, result.stdout[-4000:]
    assert [(r["iteration"], r["cycle"], r["exit_code"]) for r in results] == [(ITERS, 0, 0)] * 2
    assert results[0]["weights"] == results[1]["weights"]
    assert flag.exists()
    assert not kinds(events, "fault_detected") and not kinds(events, "restart_begun")
    return results[0]["weights"]


def shared_reference_weights(tmp_path_factory) -> str:
    """reference_weights, run once per test session: pytest-xdist's workers of one session
    (PYTEST_XDIST_TESTRUNUID) share it through a file under a lock."""
    session = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if session is None:
        return reference_weights(tmp_path_factory.mktemp("reference"))
    shared = tmp_path_factory.getbasetemp().parent
    result = shared / f"megatron_reference-{session}.json"
    with open(shared / f"megatron_reference-{session}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            atomic_write_json(str(result), {"weights": reference_weights(shared / f"megatron_reference-{session}")})
        return json.loads(result.read_text())["weights"]


def check_recovered(result, events, results, flag, weights, kind):
    assert result.returncode == 0, result.stdout[-4000:]
    [injected] = kinds(events, "fault_injected")
    assert injected["fault"] == kind and injected["rank"] == 1
    assert len(kinds(events, "restart_begun")) == 1
    assert [(r["iteration"], r["cycle"], r["exit_code"]) for r in results] == [(ITERS, 1, 0)] * 2
    assert all(r["weights"] == weights for r in results)
    assert flag.exists()
    last_start = max(e["time"] for e in kinds(events, "workers_started"))
    assert os.stat(flag).st_mtime >= last_start - 1.0  # written by the finishing cycle
    resumed = [(e["cycle"], e["rank"]) for e in kinds(events, "training_resumed")]
    assert resumed == [(0, 0), (1, 0)], resumed  # rank 0, as each cycle's first step began
    report = goodput(events, find_incidents(events))  # `nvrx report`: every step timed, none counted twice
    assert report.steps_kept == ITERS, report
    detected = kinds(events, "fault_detected")
    if kind == "rank_killed":  # the launcher saw the death; no timeout had to fire
        assert not detected
    else:  # the hung rank was caught by a timeout, after the hang
        assert any(e["rank"] == 1 and e["time"] >= injected["time"] for e in detected)
        assert all(e["cycle"] == 0 for e in detected)
    return detected
