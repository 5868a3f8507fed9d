"""LargeValueTracker (Megatron's is_unexpectedly_large rule) and validate_result's argument checks."""

import math

import pytest
import torch

from nvrx_core.events import EventLog
from nvrx_core.rerun import (CallbackStateAdapter, DeviceIdentity, LargeValueTracker, RerunConfig,
                             RerunDataIterator, RerunStateMachine)


def test_reference_is_the_largest_of_the_first_samples_then_threshold_times_it_flags():
    tracker = LargeValueTracker()
    samples = [1.0, -3.0, 2.0]  # |value|: the reference is 3
    assert [tracker(v, threshold=10, context="loss", num_samples=3) for v in samples] == [False] * 3
    assert tracker(29.9, threshold=10, context="loss", num_samples=3) is False
    assert tracker(-30.0, threshold=10, context="loss", num_samples=3) is True  # >= 10 x 3, sign ignored
    assert tracker(torch.tensor(31.0), threshold=10, context="loss", num_samples=3) is True
    assert tracker(1e9, threshold=10, context="grad_norm", num_samples=3) is False  # its own context samples


def test_nan_and_inf_are_neither_flagged_nor_sampled():
    tracker = LargeValueTracker()
    for value in (math.nan, math.inf, 1.0):
        assert tracker(value, threshold=2, context="loss", num_samples=1) is False
    assert tracker.counts["loss"] == 1 and tracker.max_values["loss"] == 1.0
    assert tracker(math.inf, threshold=2, context="loss", num_samples=1) is False


def test_zero_reference_flags_nothing_and_resample_starts_a_new_reference():
    tracker = LargeValueTracker()
    tracker(0.0, threshold=10, context="loss", num_samples=1)
    assert tracker(5.0, threshold=10, context="loss", num_samples=1) is False
    tracker(100.0, threshold=10, context="x", num_samples=1)
    assert tracker(1.0, threshold=10, context="x", num_samples=1, resample=True) is False  # new reference 1
    assert tracker(10.0, threshold=10, context="x", num_samples=1) is True


def test_state_round_trip_and_bad_state_changes_nothing():
    tracker = LargeValueTracker()
    tracker(2.0, threshold=10, context="loss", num_samples=1)
    restored = LargeValueTracker()
    restored.load_state_dict(tracker.state_dict())
    assert restored(20.0, threshold=10, context="loss", num_samples=1) is True
    for bad, field in [({"counts": {"loss": -1}, "max_values": {"loss": 1.0}}, "counts"),
                       ({"counts": {"loss": 1}, "max_values": {"loss": math.nan}}, "max_values"),
                       ({"counts": {}}, "large_values")]:
        with pytest.raises(ValueError, match=field):
            restored.load_state_dict(bad)
    assert restored.state_dict() == tracker.state_dict()


@pytest.mark.parametrize("kwargs, name", [
    (dict(threshold=0), "threshold"), (dict(threshold="10"), "threshold"), (dict(context=""), "context"),
    (dict(num_samples=0), "num_samples"), (dict(resample=1), "resample"),
])
def test_bad_arguments_are_named(kwargs, name):
    arguments = dict(threshold=10, context="loss", num_samples=1, resample=False)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=name):
        LargeValueTracker()(1.0, **arguments)
    with pytest.raises(ValueError, match="result"):
        LargeValueTracker()(torch.ones(2), threshold=10, context="loss")


def _machine(mode, **kwargs):
    return RerunStateMachine(RerunConfig(rerun_mode=mode), device_identity=DeviceIdentity("h", "cpu:0"),
                             events=EventLog(None), **kwargs)


@pytest.mark.parametrize("mode", ["disabled", "validate_results"])
@pytest.mark.parametrize("kwargs, name, error", [
    (dict(rejection_func=None), "rejection_func", TypeError), (dict(message=3), "message", TypeError),
    (dict(comparison_func=1), "comparison_func", TypeError), (dict(tolerance=-0.1), "tolerance", ValueError),
    (dict(tolerance=math.nan), "tolerance", ValueError), (dict(tolerance="0"), "tolerance", ValueError),
    (dict(fatal="yes"), "fatal", TypeError),
])
def test_validate_result_names_a_bad_argument_at_the_call(mode, kwargs, name, error):
    machine = _machine(mode)
    arguments = dict(rejection_func=math.isnan, message="loss", comparison_func=None, tolerance=0.0, fatal=True)
    arguments.update(kwargs)
    assert machine.should_run_forward_backward(RerunDataIterator([1.0]))
    with pytest.raises(error, match=name):
        machine.validate_result(1.0, **arguments)


def test_extra_state_adapters_are_restored_for_a_rerun_beside_the_rngs():
    counter = {"value": 0}
    adapter = CallbackStateAdapter(lambda: dict(counter), lambda snapshot: counter.update(snapshot))
    machine = _machine("validate_results", extra_state_adapters=[adapter])
    data = RerunDataIterator([1.0, 2.0])
    draws, seen = [], []
    while machine.should_run_forward_backward(data):
        counter["value"] += 1
        seen.append(counter["value"])
        draws.append(torch.rand(1).item())
        machine.validate_result(next(data), lambda _: len(seen) == 1, "first run rejected", fatal=False)
    assert seen == [1, 1]  # the counter came back before the rerun
    assert draws[0] == draws[1]  # and so did the RNG (the default adapter is still there)
