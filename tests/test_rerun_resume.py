"""The rerun protocol across restarts: checkpoint, exit, new process, load_state_dict, continue.

Each phase is a run of the toy training loop in tests/test_rerun_worker.py that builds its
model, optimizer, data iterator and machine from scratch and loads the torch.save'd
checkpoint (weights_only=True) the previous phase wrote. The first test runs every phase
as a separate process with real exit codes; the others run the phases in this process
(same code, same files, only without the interpreter start-up, to keep the suite fast).

There is one CPU here, so "resumed on another device" is SIMULATED by resuming with a
different injected DeviceIdentity (--identity node-b/cpu:0).
"""

import json
from pathlib import Path

import pytest

from nvrx_core.events import read_events
from nvrx_core.rerun import iterations_to_skip, read_rejected_results
from test_rerun_worker import parse_args, train
import warm_python

WORKER = Path(__file__).with_name("test_rerun_worker.py")
SUSPECT = "node-a/cpu:0"
OTHER = "node-b/cpu:0"  # a different device identity: the simulated "other GPU"

# A test here runs up to five worker processes one after another (each bounded by its own 100 s):
# on a loaded node with four pytest workers, 120 s for the whole test was too little.
pytestmark = pytest.mark.timeout(400)


def run_process(out: Path, tag: str, *args: str) -> dict:
    proc = warm_python.popen([str(WORKER), "--out", str(out), "--tag", tag, *args],
                             stdout=warm_python.DEVNULL, stderr=warm_python.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result_file = out / f"result-{tag}-rank0.json"
    assert result_file.exists(), f"worker {tag} left no result (rc {proc.returncode}):\n{err[-3000:]}"
    result = json.loads(result_file.read_text())
    assert proc.returncode == result["exit_code"], err[-3000:]
    return result


def run_here(out: Path, tag: str, *args: str) -> dict:
    code = train(parse_args(["--out", str(out), "--tag", tag, *args]))
    result = json.loads((out / f"result-{tag}-rank0.json").read_text())
    assert code == result["exit_code"]
    return result


def reference_run(out: Path, *args: str) -> dict:
    """An uninterrupted run without the machine's interventions."""
    result = run_here(out, "reference", "--mode", "disabled", *args)
    assert result["exit_code"] == 0
    return result


def statuses(out: Path) -> list:
    return [(r.iteration, r.status, r.diagnosis) for r in read_rejected_results(str(out / "rejected.jsonl"))]


def test_persistent_error_same_device_twice_gives_up_then_other_device_convicts_first(tmp_path):
    inject = ["--inject-at-step", "3", "--inject-type", "persistent_error", "--max-same-device-restarts", "1"]
    first = run_process(tmp_path, "first", "--identity", SUSPECT, *inject)
    assert first["exit_code"] == 16
    assert first["runs"] == {"1": 1, "2": 1, "3": 2}  # step 3 ran again in place
    assert (tmp_path / "ckpt-rank0.pt").exists()

    # Rescheduled on the same device: do not re-check there; checkpoint again and exit 16.
    again = run_process(tmp_path, "again", "--resume", "--identity", SUSPECT, *inject[2:])
    assert again["exit_code"] == 16 and again["runs"] == {"3": 0}
    # Once more on the same device: the limit (1) is used up -> give up with exit 17.
    gave_up = run_process(tmp_path, "gave-up", "--resume", "--identity", SUSPECT, *inject[2:])
    assert gave_up["exit_code"] == 17 and gave_up["diagnoses"] == ["undetermined"]

    # The operator moves the job: the rerun differs there, so node-a's device is faulty.
    moved = run_process(tmp_path, "moved", "--resume", "--identity", OTHER, *inject[2:])
    assert moved["exit_code"] == 0
    assert moved["resumed_at"] == 3 and moved["runs"] == {"3": 1, "4": 1, "5": 1, "6": 1}
    assert moved["iterations"] == {"3": 3, "4": 4, "5": 5, "6": 6}
    assert moved["diagnoses"] == ["persistent_error"]

    # Model, optimizer, RNG and microbatches all survived: the result equals an uninterrupted run.
    reference = reference_run(tmp_path)
    assert {**first["losses"], **moved["losses"]} == reference["losses"]
    assert moved["param_sum"] == reference["param_sum"]

    assert statuses(tmp_path) == [
        (3, "initial_run", None), (3, "first_rerun_reproducible", None), (3, "same_device_again", None),
        (3, "same_device_gave_up", "undetermined"), (3, "second_rerun_not_reproducible", "persistent_error"),
    ]
    convicted = read_rejected_results(str(tmp_path / "rejected.jsonl"))[-1]
    assert convicted.suspect_device == "node-a cpu:0" and convicted.host == "node-b"
    exits = [e["exit_code"] for e in read_events(str(tmp_path / "events.jsonl")) if e["kind"] == "rerun_exit_requested"]
    assert exits == [16, 16, 17]


def test_injected_correct_result_reproduces_elsewhere_and_fatal_check_exits_17(tmp_path):
    inject = ["--inject-at-step", "2", "--inject-type", "correct_result"]
    first = run_here(tmp_path, "first", "--identity", SUSPECT, *inject)
    assert first["exit_code"] == 16 and first["runs"]["2"] == 2
    moved = run_here(tmp_path, "moved", "--resume", "--identity", OTHER)
    assert moved["exit_code"] == 17 and moved["runs"] == {"2": 1}
    assert moved["diagnoses"] == ["correct_result"]
    assert iterations_to_skip(str(tmp_path / "rejected.jsonl")) == {2}


def test_real_nan_from_data_is_diagnosed_as_application_data_and_can_be_skipped(tmp_path):
    data = ["--nan-at-step", "3"]
    first = run_here(tmp_path, "first", "--identity", SUSPECT, *data)
    assert first["exit_code"] == 16 and first["runs"] == {"1": 1, "2": 1, "3": 2}
    # The resumed loader starts after the NaN microbatches: they can only come from the checkpoint.
    moved = run_here(tmp_path, "moved", "--resume", "--identity", OTHER, *data)
    assert moved["exit_code"] == 17 and moved["diagnoses"] == ["correct_result"]
    records = read_rejected_results(str(tmp_path / "rejected.jsonl"))
    assert records[-1].result == "nan" and "application/data" in records[-1].detail
    assert iterations_to_skip(str(tmp_path / "rejected.jsonl")) == {3}

    # Skip the bad data: abandon the pending re-check; step 3 then trains on the next microbatches.
    skipped = run_here(tmp_path, "skipped", "--resume", "--abandon", "--identity", OTHER, *data)
    assert skipped["exit_code"] == 0
    assert skipped["iterations"] == {"3": 3, "4": 4, "5": 5, "6": 6}
    assert all(loss == loss for loss in skipped["losses"].values())  # no NaN
    assert statuses(tmp_path)[-1] == (3, "pending_rerun_abandoned", None)


def test_spike_from_data_reproduces_on_two_devices_and_training_continues(tmp_path):
    data = ["--spiky", "--spike-at-step", "5"]
    first = run_here(tmp_path, "first", "--identity", SUSPECT, *data)
    assert first["exit_code"] == 16 and first["runs"]["5"] == 2
    assert statuses(tmp_path)[0][:2] == (5, "initial_run")
    assert read_rejected_results(str(tmp_path / "rejected.jsonl"))[0].message == "spiky loss"
    moved = run_here(tmp_path, "moved", "--resume", "--identity", OTHER, *data)
    # Not fatal: a genuine spike is kept and training goes on.
    assert moved["exit_code"] == 0 and moved["diagnoses"] == ["correct_result"]
    assert moved["runs"] == {"5": 1, "6": 1}
    reference = reference_run(tmp_path, *data)
    assert {**first["losses"], **moved["losses"]} == reference["losses"]
