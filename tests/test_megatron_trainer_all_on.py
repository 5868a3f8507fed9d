"""The reference Bridge-style trainer under a real ft_launcher with 2 gloo ranks, with the
other configs switched on: faults still recover with the straggler manager, the rerun facade
and the signal handler on; an exception recovers in-process (same processes); a 30% slower
rank stops every rank with exit 19 after a checkpoint; NaN losses end in exit 16 or 17."""

import pytest
import torch

from harness.launcher import kinds
from megatron_trainer import (ALL_ON, HEARTBEATS, ITERS, RECORDED_TRAINER, TIMEOUTS, check_recovered,
                              shared_reference_weights, saved_iteration, train)
from nvrx_core.exit_codes import ExitCode

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return shared_reference_weights(tmp_path_factory)


def test_with_straggler_rerun_and_signal_handler_on_a_hung_rank_still_recovers(tmp_path, weights):
    """The hung rank under section timeouts: the case where the parts switched on could most
    plausibly get in the way (a section left open, a collective of the straggler detector
    or the rerun machine waiting on the frozen rank, the signal handler and the monitor's kill)."""
    outcome = train(tmp_path, TIMEOUTS["sections"], "--simulated-fault", "rank_hung:1:3", *ALL_ON)
    check_recovered(*outcome, weights, "rank_hung")
    assert [r["stragglers"] for r in outcome[2]] == [[], []]  # the manager reported, and flagged no one


def test_an_exception_recovers_in_process_in_the_same_processes(tmp_path, weights):
    result, events, results, flag = train(tmp_path, HEARTBEATS, "--inprocess", "--raise-at", "1:55", restarts=0)
    assert result.returncode == 0, result.stdout[-4000:]
    assert [(r["iteration"], r["cycle"], r["exit_code"]) for r in results] == [(ITERS, 0, 0)] * 2
    assert all(r["weights"] == weights for r in results)
    assert len(kinds(events, "workers_started")) == 1 and not kinds(events, "restart_begun")  # same processes
    restarted = kinds(events, "inprocess_restarted")
    assert sorted(e["rank"] for e in restarted) == [0, 1]
    assert flag.exists()


def test_under_respawn_rank_a_killed_rank_is_replaced_and_training_rolls_forward(tmp_path, weights):
    """ft_launcher --ft-restart-policy respawn-rank: the killed rank's replacement takes the model,
    AdamW state and iteration from rank 0 (roll_forward), not from the checkpoint; rank 0 keeps
    its process; the weights are the fault-free run's."""
    result, events, results, flag = train(tmp_path, HEARTBEATS, "--inprocess", "--kill-at", "1:55", restarts=0,
                                          launcher_args=["--ft-restart-policy", "respawn-rank"])
    assert result.returncode == 0, result.stdout[-4000:]
    assert [(r["iteration"], r["cycle"], r["exit_code"]) for r in results] == [(ITERS, 0, 0)] * 2
    assert all(r["weights"] == weights for r in results)
    [respawned] = kinds(events, "rank_respawned")
    assert respawned["rank"] == 1 and not kinds(events, "restart_begun")
    started = kinds(events, "workers_started")
    assert len(started) == 1 and started[0]["pids"]["0"] not in (respawned["old_pid"], respawned["new_pid"])
    assert flag.exists()


def test_a_30_percent_slower_rank_stops_every_rank_with_exit_19_after_a_checkpoint(tmp_path):
    """On a recorded timeline (tests/scripts/megatron_recorded_time.py): each forward takes 30 ms
    of the straggler manager's clock, 39 ms on rank 1, and the gradient all-reduce ends when the
    last rank arrived (+1 ms), so a step is 40 ms of recorded time on both ranks and rank 0
    waits 9 ms of it. Rank 1's relative score is exactly 30/39 = 1/1.3 against the 0.85
    threshold; with 1 s report intervals it is a suspect at report 1 (iteration 25) and flagged
    at report 2 (iteration 50), where every rank checkpoints and exits 19. Under the real
    ft_launcher, gloo and checkpoints; only the straggler manager's clock is recorded."""
    result, events, results, flag = train(tmp_path, HEARTBEATS, "--straggler", "--straggler-stop-threshold", "0.85",
                                          "--slow-rank", "1:1.3", "--save-interval", "1000", iters=1000,
                                          trainer=RECORDED_TRAINER)  # the one checkpoint is the stop's
    assert result.returncode == ExitCode.STRAGGLER_STOP, result.stdout[-4000:]
    assert [r["exit_code"] for r in results] == [ExitCode.STRAGGLER_STOP] * 2
    assert [r["stragglers"] for r in results] == [[1], [1]]
    assert [r["iteration"] for r in results] == [50, 50] and saved_iteration(tmp_path) == 50
    scores = results[0]["relative_scores"]  # rank 0 scores the report; rank 1 holds the decision
    assert scores["0"] == 1.0 and scores["1"] == pytest.approx(1 / 1.3, abs=1e-9), scores
    heatmap = kinds(events, "straggler_scores")
    assert [(e["report_index"], e["scores"]) for e in heatmap] == [(1, {"0": 1.0, "1": 0.7692}),
                                                                    (2, {"0": 1.0, "1": 0.7692})]
    found = kinds(events, "straggler_found")
    assert sorted((e["straggler_rank"], e["score_kind"], e["scope"], e["score"], e["threshold"], e["consecutive"],
                   e["report_index"], e["action"]) for e in found) == [
        (1, "relative", scope, round(1 / 1.3, 4), 0.85, 2, 2, "stop") for scope in ("overall", "train_step")]
    assert not kinds(events, "restart_begun") and not flag.exists()


RERUN = ["--rerun-mode", "validate_results"]


def test_a_nan_that_comes_with_the_data_checkpoints_and_exits_16(tmp_path):
    result, events, results, flag = train(tmp_path, HEARTBEATS, *RERUN, "--nan-at", "0:25", iters=40)
    assert result.returncode == ExitCode.RERUN_RESUME_ELSEWHERE, result.stdout[-4000:]
    assert [(r["exit_code"], r["iteration"]) for r in results] == [(ExitCode.RERUN_RESUME_ELSEWHERE, 24)] * 2
    saved = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=False)
    assert saved["iteration"] == 24 and saved["rerun_state_machine"] is not None  # the step to re-run elsewhere
    [rejected, reproduced] = [e for e in events if e["kind"].startswith("rerun_result") and e["rank"] == 0]
    assert (rejected["iteration"], reproduced["iteration"]) == (25, 25)
    assert not kinds(events, "rerun_diagnosis")  # decided only on another device
    assert not flag.exists()


def test_a_transient_nan_in_the_fatal_nan_check_exits_17(tmp_path):
    """Bridge's NaN check is fatal: a NaN that does not come back on the re-run is a transient
    fault that may have corrupted state, so the job stops (megatron-core's rule)."""
    result, events, results, flag = train(tmp_path, HEARTBEATS, *RERUN, "--transient-nan-at", "0:25", iters=40)
    assert result.returncode == ExitCode.RERUN_VALIDATION_FAILED, result.stdout[-4000:]
    assert [(r["exit_code"], r["iteration"]) for r in results] == [(ExitCode.RERUN_VALIDATION_FAILED, 24)] * 2
    [diagnosis] = kinds(events, "rerun_diagnosis")
    assert (diagnosis["diagnosis"], diagnosis["rank"], diagnosis["iteration"]) == ("transient_error", 0, 25)
    assert not flag.exists()
