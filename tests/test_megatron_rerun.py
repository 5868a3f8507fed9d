"""nvrx_megatron.rerun_state_machine: Megatron's RerunStateMachine names on nvrx_core.rerun.

The loop is Megatron's train step (while should_run_forward_backward / validate_result /
should_checkpoint_and_exit). In one process: disabled mode, a transient NaN (goes on, or
exit 17 when fatal), a NaN from the data (checkpoint, exit 16; resumed on another device:
exit 17), a spike through is_unexpectedly_large, the state through torch.save, bad input.
Two spawned gloo ranks: a NaN on one rank makes both rerun and both go on.
"""

import datetime
import functools
import io
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from harness.ranks import run_spawned_ranks

from nvrx_core.durable import atomic_write_json
from nvrx_core.events import EventLog
from nvrx_core.rerun import DeviceIdentity, RerunStateError
from nvrx_megatron.config import RerunStateMachineConfig
from nvrx_megatron.rerun_state_machine import (EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                                               EXIT_CODE_RESUME_TO_DISAMBIGUATE, RerunDataIterator,
                                               RerunStateMachine, RerunValidationError)

GPU_A, GPU_B = DeviceIdentity("node-a", "cuda:0", "GPU-a"), DeviceIdentity("node-b", "cuda:0", "GPU-b")


def _machine(mode="validate_results", identity=GPU_A, **kwargs):
    return RerunStateMachine(RerunStateMachineConfig(rerun_mode=mode), device_identity=identity,
                             events=EventLog(None), **kwargs)


def _step(machine, data, model=lambda batch: batch, fatal=True):
    """One Megatron-style step; returns (forward passes run, should_checkpoint_and_exit())."""
    runs = 0
    while machine.should_run_forward_backward(data):
        runs += 1
        loss = torch.tensor(model(next(data)))
        machine.validate_result(loss, torch.isnan, "loss is NaN", fatal=fatal)
    return runs, machine.should_checkpoint_and_exit()


def test_exit_codes_come_from_the_suite_table():
    assert (EXIT_CODE_RESUME_TO_DISAMBIGUATE, EXIT_CODE_FAILED_ON_RESULT_VALIDATION) == (16, 17)


def test_disabled_by_default_runs_once_and_guards_a_fatal_nan():
    machine = RerunStateMachine()
    assert machine.mode.value == "disabled"
    data = iter([1.0, math.nan, math.nan])  # disabled: any iterator will do
    assert _step(machine, data) == (1, (False, False, 0))
    with pytest.raises(RerunValidationError):
        _step(machine, data)
    machine = RerunStateMachine()
    assert _step(machine, data, fatal=False) == (1, (False, False, 0))  # only recorded
    assert machine.state_dict(None) is None  # nothing pending, as Megatron
    assert machine.state_dict(None, force=True)["machine"]["current_iteration"] == 1


def _flaky(nan_on_calls):
    """A device that computes NaN on the given forward calls (1-based), whatever the data."""
    calls = {"n": 0}

    def model(batch):
        calls["n"] += 1
        return math.nan if calls["n"] in nan_on_calls else batch
    return model


def test_transient_nan_is_rerun_and_training_goes_on_when_not_fatal():
    machine = _machine()
    data = RerunDataIterator([1.0, 2.0, 3.0])
    model = _flaky({2})
    assert _step(machine, data, model, fatal=False) == (1, (False, False, 0))
    assert _step(machine, data, model, fatal=False) == (2, (False, False, 0))  # rerun in place: differs
    assert _step(machine, data, model, fatal=False) == (1, (False, False, 0))  # the next step as usual
    assert [d.diagnosis for d in machine.machine.diagnoses] == ["transient_error"]


def test_transient_nan_in_a_fatal_check_exits_17():
    machine = _machine()
    assert _step(machine, RerunDataIterator([1.0]), _flaky({1})) == (2, (False, True, 17))


def _saved(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_nan_from_the_data_checkpoints_exits_16_then_17_on_another_device():
    machine = _machine()
    data = RerunDataIterator([1.0, math.nan, 3.0])
    _step(machine, data)
    assert _step(machine, data) == (2, (True, True, 16))  # reproduced in place: resume elsewhere
    state = _saved(machine.state_dict(data, "torch_dist"))
    assert machine.current_iteration == 2

    resumed = _machine(identity=GPU_B)
    resumed.load_state_dict(state)
    fresh = RerunDataIterator([3.0])  # positioned after the drawn microbatches
    assert _step(resumed, fresh) == (1, (False, True, 17))  # NaN again elsewhere: the data, fatal
    assert [d.diagnosis for d in resumed.machine.diagnoses] == ["correct_result"]


def test_resumed_on_the_same_device_asks_again_for_another():
    machine = _machine()
    data = RerunDataIterator([math.nan])
    assert _step(machine, data)[1] == (True, True, 16)
    again = _machine(identity=GPU_A)
    again.load_state_dict(_saved(machine.state_dict(data)))
    assert _step(again, RerunDataIterator([]))[1] == (True, True, 16)


def test_spike_through_is_unexpectedly_large_is_rechecked_elsewhere_then_goes_on():
    machine = _machine()
    values = [1.0, 2.0, 1.5, 40.0, 1.0]
    data = RerunDataIterator(values)
    outcomes = []
    for _ in range(4):
        runs = 0
        while machine.should_run_forward_backward(data):
            runs += 1
            loss = torch.tensor(next(data))
            machine.validate_result(loss, functools.partial(machine.is_unexpectedly_large, threshold=10,
                                                            context="loss", num_samples=3),
                                    "Spiky loss", fatal=False)
        outcomes.append((runs, machine.should_checkpoint_and_exit()))
    assert outcomes == [(1, (False, False, 0))] * 3 + [(2, (True, True, 16))]  # 40 >= 10 x 2
    state = _saved(machine.state_dict(data))

    resumed = _machine(identity=GPU_B)
    resumed.load_state_dict(state)
    assert _step(resumed, RerunDataIterator([1.0]), fatal=False)[1] == (False, False, 0)  # a real spike: go on
    assert resumed.is_unexpectedly_large(25.0, threshold=10, context="loss", num_samples=3)  # reference kept


def test_state_save_and_restore_funcs_bring_extra_state_back_for_the_rerun():
    extra = {"tracker": 0}
    machine = _machine(state_save_func=lambda: dict(extra), state_restore_func=extra.update)
    seen = []

    def model(batch):
        extra["tracker"] += 1
        seen.append(extra["tracker"])
        return math.nan if len(seen) == 1 else batch
    _step(machine, RerunDataIterator([1.0]), model, fatal=False)
    assert seen == [1, 1]


def test_current_iteration_can_be_aligned_between_steps():
    machine = _machine()
    machine.current_iteration = 100
    _step(machine, RerunDataIterator([1.0]))
    assert machine.current_iteration == 101
    with pytest.raises(ValueError, match="current_iteration"):
        machine.current_iteration = -1


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="expected an object with RerunStateMachineConfig's fields"):
        RerunStateMachine(object())
    with pytest.raises(ValueError, match="state_save_func and state_restore_func"):
        RerunStateMachine(state_save_func=dict)
    with pytest.raises(ValueError, match="max_same_device_restarts"):
        _machine(max_same_device_restarts=-1)
    machine = _machine()
    data = RerunDataIterator([1.0])
    assert machine.should_run_forward_backward(data)
    with pytest.raises(ValueError, match="tolerance"):
        machine.validate_result(torch.tensor(1.0), torch.isnan, "loss", tolerance=-1)
    with pytest.raises(TypeError, match="rejection_func"):
        machine.validate_result(torch.tensor(1.0), "isnan", "loss")
    with pytest.raises(ValueError, match="threshold"):
        machine.is_unexpectedly_large(torch.tensor(1.0), threshold=-10, context="loss")
    with pytest.raises(TypeError, match="RerunDataIterator"):
        _machine().should_run_forward_backward(iter([1.0]))
    fresh = _machine()
    for bad in ("checkpoint", {"format": "other"}, {"format": "nvrx_megatron.rerun_state_machine/1",
                                                   "machine": {}, "large_values": {}}):
        with pytest.raises(RerunStateError, match="state_dict|large_values|rerun state"):
            fresh.load_state_dict(bad)
    assert fresh.current_iteration == 0  # nothing changed


def test_on_a_real_gloo_group_of_one():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        machine = _machine()
        assert _step(machine, RerunDataIterator([1.0, 2.0])) == (1, (False, False, 0))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- real gloo ranks

NAN_RANK = 1


def _rank_main(rank, world, port, out_dir):
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        identity = DeviceIdentity(f"node-{rank}", "cpu:0")
        machine = _machine(identity=identity)
        data = RerunDataIterator([1.0, 2.0, 3.0])
        model = _flaky({2} if rank == NAN_RANK else set())
        steps = [_step(machine, data, model, fatal=False) for _ in range(3)]
        atomic_write_json(os.path.join(out_dir, f"rank{rank}.json"),
                          {"steps": [[runs, list(outcome)] for runs, outcome in steps]})
    finally:
        dist.destroy_process_group()


def test_a_nan_on_one_rank_makes_every_rank_rerun_and_go_on(tmp_path):
    world = 2
    run_spawned_ranks(_rank_main, world, str(tmp_path))
    for r in range(world):
        steps = json.load(open(tmp_path / f"rank{r}.json"))["steps"]
        assert steps == [[1, [False, False, 0]], [2, [False, False, 0]], [1, [False, False, 0]]]
