"""The reference Bridge-style trainer (examples/megatron_style) under a real ft_launcher with 2
gloo ranks: Bridge's simulated faults (a killed rank, a hung rank) end in a finished job with
the fault-free weights, under heartbeat-only and under section timeouts, both shorter than the
job; a transient loss spike is re-run in place and training goes on to the same weights."""

import pytest

from harness.launcher import kinds
from megatron_trainer import HEARTBEATS, ITERS, TIMEOUTS, check_recovered, shared_reference_weights, train

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return shared_reference_weights(tmp_path_factory)


# A killed rank is seen by the launcher whatever the timeouts; a hung one only by a timeout. The
# hang under heartbeats alone is also run on Slurm (test_slurm_nemo_run) and by test_ft_launcher.
@pytest.mark.parametrize("mode, kind", [("heartbeats", "rank_killed"), ("sections", "rank_hung")])
def test_a_simulated_fault_ends_in_a_finished_job_with_the_fault_free_weights(tmp_path, weights, mode, kind):
    outcome = train(tmp_path, TIMEOUTS[mode], "--simulated-fault", f"{kind}:1:3")
    detected = check_recovered(*outcome, weights, kind)
    reasons = {e["reason"] for e in detected}
    if mode == "heartbeats":
        assert reasons <= {"heartbeat timeout"}
    else:
        # SIGSTOP lands wherever rank 1 is: in a step, between steps, or in a checkpoint save
        assert reasons <= {"section 'step' timeout", "section 'checkpointing' timeout", "out-of-section timeout"}


def test_a_transient_loss_spike_is_re_run_and_training_goes_on_to_the_fault_free_weights(tmp_path, weights):
    """The spiky-loss check is not fatal: the step is re-run in place and its clean result kept."""
    result, events, results, flag = train(tmp_path, HEARTBEATS, "--rerun-mode", "validate_results",
                                          "--check-for-spiky-loss", "--spike-at", "1:150")
    assert result.returncode == 0, result.stdout[-4000:]
    assert [(r["exit_code"], r["iteration"]) for r in results] == [(0, ITERS)] * 2
    assert all(r["weights"] == weights for r in results)
    [diagnosis] = kinds(events, "rerun_diagnosis")
    assert (diagnosis["diagnosis"], diagnosis["rank"], diagnosis["iteration"]) == ("transient_error", 1, 150)
    assert diagnosis["message"] == "Spiky loss"
    assert flag.exists()
