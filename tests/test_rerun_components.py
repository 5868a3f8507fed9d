"""The rerun machine's parts on their own: spiky-loss baseline, comparison and percentiles,
microbatch replay, RNG snapshots, device identity, the rejected-results log, injection."""

import math
import random

import pytest
import torch

from nvrx_core.rerun import (
    DeviceIdentity, RerunDataIterator, RerunDiagnostic, RerunErrorInjector, RngStateAdapter, SpikyLossDetector,
    iterations_to_skip, local_device_identity, read_rejected_results, relative_difference,
)
from nvrx_core.rerun.collective import CollectiveVote
from nvrx_core.rerun.report import RejectedResult, RejectedResultsLog
from nvrx_core.rerun.stats import DeterminismStats, combine_ranks, percentile, summarize


def noisy_decreasing_curve(n=600, seed=0):
    """A typical loss curve: fast early fall, slow decay, +-15% multiplicative noise."""
    rng = random.Random(seed)
    return [(0.3 + 8.0 * math.exp(-i / 40.0)) * (1 + rng.uniform(-0.15, 0.15)) for i in range(n)]


def detector(**kw):
    args = dict(factor=10.0, window=100, warmup=20, min_samples=10)
    args.update(kw)
    return SpikyLossDetector(**args)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["host", "tensor-ops"])
def test_normal_curve_is_never_spiky_and_a_synthetic_spike_is(as_tensor):
    curve = noisy_decreasing_curve()
    spiked = list(curve)
    spiked[400] = curve[400] * 25
    for losses, expected in ((curve, []), (spiked, [400])):
        check = detector(tensor_ops_on_cpu=as_tensor)
        flags = [check(torch.tensor(v) if as_tensor else v) for v in losses]
        if as_tensor:
            assert all(f.dtype == torch.bool and f.dim() == 0 for f in flags)
        assert [i for i, f in enumerate(flags) if bool(f)] == expected


def test_tensor_and_host_paths_agree_and_share_state():
    losses = noisy_decreasing_curve(300, seed=3) + [50.0, float("nan"), float("inf"), 0.5]
    on_host, on_tensor = detector(window=30), detector(window=30, tensor_ops_on_cpu=True)
    assert [on_host(torch.tensor(v)) for v in losses] == [bool(on_tensor(torch.tensor(v))) for v in losses]
    # A detector moves its window between the paths when its input changes kind.
    reference, switching = detector(window=30), detector(window=30, tensor_ops_on_cpu=True)
    expected = [reference(v) for v in losses]
    flags = [bool(switching(torch.tensor(v))) if i % 2 else switching(v) for i, v in enumerate(losses)]
    assert flags == expected and sum(expected) >= 2
    assert switching.baseline == pytest.approx(reference.baseline, rel=1e-6)
    assert on_host.baseline == pytest.approx(on_tensor.baseline, rel=1e-6)
    assert on_host.state_dict()["observed"] == on_tensor.state_dict()["observed"] == len(losses)


def test_warmup_is_excluded_and_non_finite_losses_are_not_spikes():
    check = detector(warmup=5, min_samples=3)
    assert [check(v) for v in (100.0, 50.0, 1.0, 1.0, 1.0)] == [False] * 5  # warm-up: not even recorded
    assert check.baseline is None
    assert [check(v) for v in (1.0, 1.0, 1.0)] == [False] * 3
    assert check.baseline == 1.0
    assert not check(float("nan"))  # NaN is the NaN check's business
    assert check(float("inf")) and not check(float("-inf"))
    assert check.state_dict()["window"] == [1.0, 1.0, 1.0]  # NaN/Inf never enter the baseline
    assert check(10.5) and not check(9.5)


def test_median_baseline_is_robust_to_an_accepted_outlier_and_follows_the_curve():
    check = detector(warmup=0, min_samples=5, window=9)
    for v in [1.0] * 8 + [9.0]:  # 9.0 is below 10x and accepted
        check(v)
    assert check.baseline == 1.0  # a mean would have moved to ~1.9
    assert check(10.5)
    for v in [0.1] * 9:  # the loss fell: the window follows it
        check(v)
    assert check.baseline == pytest.approx(0.1) and check(1.2)


def test_spiky_state_round_trip_and_validation():
    check = detector(warmup=2, min_samples=2)
    for v in (5.0, 4.0, 3.0, 2.0, 1.5):
        check(torch.tensor(v))
    state = check.state_dict()
    assert state == {"observed": 5, "window": [3.0, 2.0, 1.5]}
    restored = detector(warmup=2, min_samples=2)
    restored.load_state_dict(state)
    assert restored.baseline == 2.0 and restored(30.0) and not restored(19.0)
    with pytest.raises(ValueError, match=r"spiky_loss.window=\[1.0, nan\]: must be a list of finite numbers"):
        restored.load_state_dict({"observed": 1, "window": [1.0, float("nan")]})
    with pytest.raises(ValueError, match="spiky_loss.observed=-1"):
        restored.load_state_dict({"observed": -1, "window": []})
    with pytest.raises(ValueError, match="need factor > 1"):
        SpikyLossDetector(factor=0.5, window=10, warmup=0, min_samples=1)


def test_relative_difference():
    assert relative_difference(2.0, 2.0) == 0.0
    assert relative_difference(2.0, 1.0) == 0.5
    assert relative_difference(0.0, 0.0) == 0.0
    assert relative_difference(float("nan"), float("nan")) == 0.0  # a NaN that comes back reproduced
    assert relative_difference(float("nan"), 1.0) == math.inf
    assert relative_difference(float("inf"), float("inf")) == 0.0
    assert relative_difference(float("inf"), float("-inf")) == math.inf
    a = torch.tensor([1.0, 2.0, float("nan")])
    assert float(relative_difference(a, a.clone())) == 0.0
    assert float(relative_difference(a, torch.tensor([1.0, 2.5, float("nan")]))) == pytest.approx(0.2)
    assert float(relative_difference(a, torch.tensor([1.0, 2.0, 3.0]))) == math.inf
    assert float(relative_difference(a, torch.ones(2))) == math.inf  # shapes differ
    assert float(relative_difference(torch.tensor(4.0), 2.0)) == 0.5  # tensor vs number


def test_percentiles_and_rank_summary():
    values = [float(v) for v in range(101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile([3.0], 90) == 3.0
    assert percentile([0.0, 10.0], 90) == 9.0
    assert summarize([]) == {"count": 0, "p50": None, "p90": None, "p99": None, "max": None}
    report = combine_ranks([{"loss": [0.0, 0.0]}, {"loss": [0.5, 1e-3], "grad": [2.0]}], iteration=7)
    assert report["world_size"] == 2 and report["iteration"] == 7
    assert report["calls"]["loss"]["count"] == 4 and report["calls"]["loss"]["max"] == 0.5
    assert report["calls"]["loss"]["max_rank"] == 1 and report["calls"]["grad"]["count"] == 1


def test_determinism_stats_read_a_step_back_at_once():
    stats = DeterminismStats()
    stats.add("loss", torch.tensor(0.25, dtype=torch.float64))
    stats.add("loss", 0.5)
    stats.add("grad", torch.tensor(0.0))
    stats.end_step()
    assert stats.take() == {"loss": [0.25, 0.5], "grad": [0.0]}
    assert stats.take() == {}


def test_data_iterator_replays_the_step_and_carries_its_microbatches():
    data = RerunDataIterator(range(100))
    data.advance()
    assert [next(data), next(data)] == [0, 1]
    data.rewind()
    assert [next(data), next(data), next(data)] == [0, 1, 2]  # the rerun asked one more: from the source
    assert data.drawn == 3 and data.state_dict(include_batches=True)["batches"] == [0, 1, 2]
    data.advance()
    assert next(data) == 3
    state = data.state_dict(include_batches=True)
    assert state == {"format_version": 1, "drawn": 4, "batches": [3]}
    assert data.state_dict(include_batches=False)["batches"] is None

    resumed = RerunDataIterator(iter(range(4, 100)))  # a fresh loader positioned after `drawn`
    resumed.load_state_dict(state)
    assert [next(resumed), next(resumed)] == [3, 4] and resumed.drawn == 5


@pytest.mark.parametrize("state, error", [
    ([], "data_iterator=list: must be a mapping"),
    ({"format_version": 2, "drawn": 0, "batches": None}, "format_version=2: must be 1"),
    ({"format_version": 1, "drawn": -1, "batches": None}, "drawn=-1: must be an integer >= 0"),
    ({"format_version": 1, "drawn": 1, "batches": "x"}, "batches='x': must be a list"),
    ({"format_version": 1, "drawn": 1, "batches": [1, 2]}, "holds 2 microbatches but only 1 were drawn"),
])
def test_data_iterator_rejects_malformed_state(state, error):
    data = RerunDataIterator([])
    with pytest.raises(ValueError, match=error):
        data.load_state_dict(state)


def test_rng_adapter_restores_every_generator_and_checks_snapshots():
    adapter = RngStateAdapter()
    snapshot = adapter.capture()
    first = (torch.rand(3), random.random(), torch.nn.functional.dropout(torch.ones(8), 0.5))
    adapter.restore(snapshot)
    second = (torch.rand(3), random.random(), torch.nn.functional.dropout(torch.ones(8), 0.5))
    assert torch.equal(first[0], second[0]) and first[1] == second[1] and torch.equal(first[2], second[2])
    adapter.check_snapshot(snapshot, "saved_state[0]")
    assert snapshot["torch_cuda"] is None  # a CPU adapter never touches CUDA
    with pytest.raises(ValueError, match=r"saved_state\[0\].torch_cpu: must be a uint8 tensor"):
        adapter.check_snapshot(dict(snapshot, torch_cpu=[1, 2]), "saved_state[0]")
    with pytest.raises(ValueError, match="must be a mapping with keys"):
        adapter.check_snapshot({"torch_cpu": snapshot["torch_cpu"]}, "saved_state[0]")


def test_device_identity(monkeypatch):
    gpu = DeviceIdentity("node-a", "cuda:0", uuid="GPU-1234")
    renumbered = DeviceIdentity("node-a", "cuda:3", uuid="GPU-1234")
    assert gpu.key == renumbered.key == "GPU-1234"  # the UUID identifies the physical GPU
    assert DeviceIdentity("node-a", "cpu:1").key == "node-a/cpu:1"
    assert DeviceIdentity.from_dict(gpu.to_dict(), "f") == gpu
    with pytest.raises(ValueError, match="f.host='': must be a non-empty string"):
        DeviceIdentity.from_dict({"host": "", "device": "cpu:0", "uuid": None}, "f")
    monkeypatch.setenv("LOCAL_RANK", "3")
    local = local_device_identity(torch.device("cpu"))
    assert local.device == "cpu:3" and local.uuid is None and local.host


def test_rejected_results_log_survives_a_torn_line_and_lists_data_to_skip(tmp_path):
    path = tmp_path / "sub" / "rejected.jsonl"
    log = RejectedResultsLog(str(path))
    base = dict(time=1.0, rank=0, host="h", device="h cpu:0", message="NaN/Inf loss", result="nan")
    log.append(RejectedResult(iteration=3, status="initial_run", **base))
    log.append(RejectedResult(iteration=3, status="second_rerun_reproducible", diagnosis="correct_result", **base))
    log.append(RejectedResult(iteration=9, status="second_rerun_not_reproducible", diagnosis="persistent_error", **base))
    with open(path, "a") as f:
        f.write('{"iteration": 12, "status": "initial_r')  # a writer killed mid-line
    records = read_rejected_results(str(path))
    assert [(r.iteration, r.diagnosis) for r in records] == [(3, None), (3, "correct_result"), (9, "persistent_error")]
    assert iterations_to_skip(str(path)) == {3}
    assert iterations_to_skip(str(tmp_path / "absent.jsonl")) == set()


def test_injector_rates_and_planned_comparisons():
    assert not any(RerunErrorInjector(0, RerunDiagnostic.TRANSIENT_ERROR).draw() for _ in range(100))
    assert all(RerunErrorInjector(1, "persistent_error").draw() is RerunDiagnostic.PERSISTENT_ERROR for _ in range(10))
    quarter = RerunErrorInjector(4, "correct_result", rng=random.Random(1))
    hits = sum(quarter.draw() is not None for _ in range(4000))
    assert 800 < hits < 1200
    inj = RerunErrorInjector
    kinds = RerunDiagnostic
    assert [inj.in_place_comparison(k) for k in kinds] == [0.0, math.inf, 0.0]  # correct, transient, persistent
    assert [inj.elsewhere_comparison(k) for k in kinds] == [0.0, 0.0, math.inf]


def test_collective_vote_without_a_process_group_is_local():
    vote = CollectiveVote()
    assert vote.max(0) == 0 and vote.max(True) == 1 and vote.max(torch.tensor(True)) == 1
    assert vote.world_size == 1 and vote.rank == 0 and vote.device.type == "cpu"
    assert vote.gather_json({"a": [1.5, math.inf]}) == [{"a": [1.5, math.inf]}]
