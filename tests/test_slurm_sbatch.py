"""docs/slurm.md's plain sbatch script (examples/slurm/ft_launcher.sbatch) on the local Slurm
cluster: 2 training nodes x 2 ranks and 1 hot spare in one allocation.

- A training node crashes (its slurmd and processes SIGKILLed, the node DOWN): the spare takes
  its group rank inside the job, training is going again within 10 s, Slurm never requeues.
- Slurm's preemption warning (`scancel --signal=TERM`: every process of the job's steps, as
  `--signal=TERM@N` delivers it): every rank saves at one step, the script requeues the job
  without counting a failed attempt, and the next attempt finishes.
Both end with the weights of a fault-free run.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from harness.launcher import REPO, kinds
from nvrx_core.events import read_events
from slurm_cluster import (TRAINER, cluster_env, crash_node, exclusive, nodes_back, reference_weights, slurm,
                           wait_for_job)

pytestmark = pytest.mark.timeout(900)

SBATCH = os.path.join(REPO, "examples", "slurm", "ft_launcher.sbatch")
ITERS = 120


@pytest.fixture(scope="module", autouse=True)
def cluster():
    env = cluster_env()
    with exclusive():
        yield env


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return reference_weights(str(tmp_path_factory.getbasetemp().parent), ITERS)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def submit(root, nodes, step_time, *sbatch_args):
    """The documented script, as a user submits it; the job id."""
    env = dict(os.environ, **cluster_env(), PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               OMP_NUM_THREADS="1", NPROC_PER_NODE="2", SPARE_NODES="1", RDZV_PORT=str(free_port()),
               STATE_DIR=str(root / "state"), PYTHONUNBUFFERED="1")
    env.pop("FAULT_TOL_FINISHED_FLAG_FILE", None)
    env.pop("NVRX_EVENTS_FILE", None)
    out = subprocess.run(
        ["sbatch", "--parsable", f"--nodes={nodes}", "--time=00:15:00", f"--output={root}/slurm-%j.out",
         f"--chdir={root}", *sbatch_args, SBATCH, TRAINER, "--save", str(root / "ckpt"), "--train-iters", str(ITERS),
         "--step-time", str(step_time), "--result-dir", str(root / "results"), "--enable-ft", "--exit-signal-handler"],
        capture_output=True, text=True, env=env, timeout=60, check=True)
    return out.stdout.strip().split(";")[0]


def results(root):
    return [json.loads((root / "results" / f"result{r}.json").read_text()) for r in range(4)
            if (root / "results" / f"result{r}.json").exists()]


def log(root):
    return "\n".join(p.read_text()[-4000:] for p in sorted(root.glob("slurm-*.out")))


def assert_finished_with(root, record, weights):
    assert record.state == "COMPLETED", (record, log(root))
    assert [r["iteration"] for r in results(root)] == [ITERS] * 4, log(root)
    assert all(r["weights"] == weights for r in results(root)), log(root)
    assert (root / "state" / "finished").exists()


def test_a_crashed_training_node_is_replaced_by_the_spare_within_seconds_without_a_requeue(tmp_path, weights):
    job = submit(tmp_path, 3, 0.15)
    events_file = str(tmp_path / "state" / "events.jsonl")
    crashed = []

    def crash_the_second_training_node_once_training(record):
        if crashed or not (tmp_path / "ckpt" / "checkpoint.pt").exists():
            return
        second = slurm("scontrol", "show", "hostnames", record.nodes).split()[1]  # SLURM_PROCID 1: not the store's
        crashed.append((second, time.time()))
        assert crash_node(second), "no process of the job was found on that node"

    try:
        record = wait_for_job(job, timeout=600, while_running=crash_the_second_training_node_once_training)
    finally:
        nodes_back()
    assert crashed, log(tmp_path)
    assert record.restarts == 0, record                                    # no requeue: replaced in the job
    assert_finished_with(tmp_path, record, weights)
    events = read_events(events_file)
    [activated] = kinds(events, "spare_activated")
    assert activated["group_rank"] == 1, activated
    crash_time = crashed[0][1]
    # training again: each node's monitor saw its first progress after the crash (a rank's heartbeat)
    after = sorted((e for e in kinds(events, "first_progress") if e["time"] > crash_time), key=lambda e: e["time"])
    assert {e["rank"] // 2 for e in after[:2]} == {0, 1}, after                 # ranks 0-1 and 2-3: both nodes
    assert after[1]["time"] - crash_time < 10.0, (crash_time, after)


def test_preemption_saves_at_one_step_and_requeues_without_a_failed_attempt(tmp_path, weights):
    job = submit(tmp_path, 3, 0.1)
    signalled = []

    def preempt_once_training(record):
        if signalled or not (tmp_path / "ckpt" / "checkpoint.pt").exists() or record.restarts:
            return
        signalled.append(record.restarts)
        slurm("scancel", "--signal=TERM", job)   # to every process of the steps, not the batch shell

    record = wait_for_job(job, timeout=600, while_running=preempt_once_training)
    assert signalled and record.restarts == 1, (record, log(tmp_path))
    assert not (tmp_path / "state" / "failed_attempts").exists(), (tmp_path / "state" / "failed_attempts").read_text()
    assert_finished_with(tmp_path, record, weights)
    events = read_events(str(tmp_path / "state" / "events.jsonl"))
    steps = [e["step"] for e in kinds(events, "preemption_agreed")]
    assert len(steps) == 4 and len(set(steps)) == 1, steps                  # every rank, one step
    # the first attempt's three launchers (the spare's too) exit PREEMPTED, the second's finish
    assert sorted(e["exit_code"] for e in kinds(events, "launcher_exit")) == [0, 0, 0, 18, 18, 18], log(tmp_path)
