"""nvrx_hf.NVRxFaultTolerance on a real Hugging Face Trainer: 2-rank CPU DDP runs (gloo, through
accelerate) under a real ft_launcher with its default timeouts: killed, failing and SIGTERMed
ranks, then hangs (GIL-free and GIL-held) caught by the timeouts the first run learned."""

import json
import os
import shutil

import pytest

from harness.launcher import SCRIPTS, alive, kinds, run_launcher
from nvrx_core.events import read_events
from harness import wait_for

pytestmark = pytest.mark.timeout(300)

JOB = os.path.join(SCRIPTS, "hf_ft_job.py")
# Learned timeouts are at least 6 s: a loaded 2-core machine must not look like a hang.
LEARNING = ["--ft-safety-factor", "20", "--ft-min-calculated-timeout", "6"]


def train_under_launcher(root, *job_args, restarts=0):
    root.mkdir(parents=True, exist_ok=True)
    flag = root / "finished.flag"
    result = run_launcher(
        ["--nproc-per-node", "2", "--max-restarts", str(restarts), "--events-file", str(root / "events.jsonl"),
         "--warm-start-preload", "transformers.trainer,nvrx_hf",  # as docs/hf.md advises
         *LEARNING, JOB, "--root", str(root), *job_args],
        timeout=280, env={"FAULT_TOL_FINISHED_FLAG_FILE": str(flag), "HF_HUB_OFFLINE": "1"})
    results = [json.loads((root / f"result.rank{r}.json").read_text())
               for r in range(2) if (root / f"result.rank{r}.json").exists()]
    return result, read_events(str(root / "events.jsonl")), results, flag


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A fault-free run: the weights every recovered run must end with, and learned timeouts."""
    root = tmp_path_factory.mktemp("reference")
    result, events, results, flag = train_under_launcher(root)
    assert result.returncode == 0, result.stdout[-4000:]
    assert [r["global_step"] for r in results] == [24, 24]
    assert results[0]["weights"] == results[1]["weights"]
    assert flag.exists()
    return root, results[0]["weights"]


def check_recovered(root, result, events, results, flag, reference_weights, restarts):
    assert result.returncode == 0, result.stdout[-4000:]
    assert len(kinds(events, "restart_begun")) == restarts, [e["kind"] for e in events]
    assert [(r["global_step"], r["cycle"]) for r in results] == [(24, restarts)] * 2
    assert all(r["weights"] == reference_weights for r in results)
    assert flag.exists()
    last_start = max(e["time"] for e in kinds(events, "workers_started"))
    assert os.stat(flag).st_mtime >= last_start - 1.0        # never written by a failed cycle


def test_killed_failing_and_sigtermed_ranks_recover_to_the_fault_free_weights(tmp_path, reference):
    root = tmp_path / "faults"
    result, events, results, flag = train_under_launcher(
        root, "--fault", "rank_killed:1:6:0", "--fault", "rank_exception:0:10:1", "--fault", "sigterm:1:14:2",
        restarts=3)
    check_recovered(root, result, events, results, flag, reference[1], restarts=3)
    assert {e["fault"] for e in kinds(events, "fault_injected")} == {"rank_killed", "rank_exception"}
    # nothing a rank started (its 2 DataLoader workers per cycle) outlived its cycle or the job
    loaders = [tuple(p) for name in os.listdir(root) if name.startswith("loaders.") and name.endswith(".json")
               for p in json.loads((root / name).read_text())]
    assert len(loaders) >= 2 * 2 * 4, loaders
    wait_for(lambda: not [p for p in loaders if alive(*p)], 30, "every DataLoader worker to be gone")


def test_timeouts_learned_in_one_run_catch_gil_free_and_gil_held_hangs_in_the_next(tmp_path, reference):
    """Run 1 (the reference) learned a heartbeat timeout from its own pace; run 2, started with
    only that state dir and the launcher's default timeouts (45 min between heartbeats), has a
    rank hang twice: each is caught within the learned timeout."""
    source, weights = reference
    learned = json.loads((source / "out" / "ft_state" / "ft_state.json").read_text())["calculated_timeouts"]
    assert learned["initial_heartbeat"] is None               # run 1 restored nothing
    assert 6.0 <= learned["heartbeat"] < 60
    root = tmp_path / "run2"
    shutil.copytree(source / "out" / "ft_state", root / "out" / "ft_state")
    result, events, results, flag = train_under_launcher(
        root, "--fault", "rank_hung:0:10:0", "--fault", "rank_hung_gil:1:14:1", restarts=2)
    check_recovered(root, result, events, results, flag, weights, restarts=2)
    for cycle, (kind, rank) in enumerate((("rank_hung", 0), ("rank_hung_gil", 1))):
        [hang] = [e for e in kinds(events, "fault_injected") if e["fault"] == kind]
        [detected] = [e for e in kinds(events, "fault_detected") if e["cycle"] == cycle and e["rank"] == rank]
        assert detected["reason"] == "heartbeat timeout"
        # the learned timeout caught it (the margin is what a loaded 2-core node adds between
        # the deadline and the monitor's report), not the launcher's 45 minutes
        assert detected["time"] - hang["time"] <= learned["heartbeat"] + 15.0, (detected, hang, learned)

