"""RerunStateMachine in one process: the protocol paths, misuse, state validation, cost.

Cross-process resume and two-rank runs are in test_rerun_resume.py / test_rerun_multirank.py.
"""

import io

import pytest
import torch

from nvrx_core.events import EventLog, read_events
from nvrx_core.exit_codes import ExitCode
from nvrx_core.rerun import (
    CallbackStateAdapter, DeviceIdentity, InvalidTransition, RerunConfig, RerunDataIterator, RerunState,
    RerunStateError, RerunStateMachine, RerunValidationError, read_rejected_results, reject_non_finite,
)

ONE = DeviceIdentity("node-a", "cpu:0")


def batches(nan_at=None, width=4):
    generator = torch.Generator().manual_seed(0)
    index = 0
    while True:
        index += 1
        x = torch.randn(4, width, generator=generator)
        if index == nan_at:
            x[0, 0] = float("nan")
        yield x


class Loop:
    """A minimal training loop following the protocol (zero_grad inside the rerun loop)."""

    def __init__(self, tmp_path=None, width=4, hidden=8, nan_at=None, tensor_ops_on_cpu=False, **config):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(width, hidden), torch.nn.Dropout(0.3), torch.nn.Linear(hidden, 1)
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        if tmp_path is not None:
            config.setdefault("result_rejected_tracker_filename", str(tmp_path / "rejected.jsonl"))
        self.events_path = str(tmp_path / "events.jsonl") if tmp_path is not None else None
        self.captures = 0
        self.machine = RerunStateMachine(
            RerunConfig(**config), device_identity=ONE, events=EventLog(self.events_path),
            tensor_ops_on_cpu=tensor_ops_on_cpu,
        )
        self.data = RerunDataIterator(batches(nan_at, width))

    def step(self, validate=None):
        losses = []
        while self.machine.should_run_forward_backward(self.data):
            self.optimizer.zero_grad()
            loss = self.model(next(self.data)).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
            (validate or self.machine.validate_loss)(loss)
        decision = self.machine.should_checkpoint_and_exit()
        if not decision[1]:
            self.optimizer.step()
        return losses, decision


CONTINUE = (False, False, ExitCode.SUCCESS)
RESUME_ELSEWHERE = (True, True, ExitCode.RERUN_RESUME_ELSEWHERE)
VALIDATION_FAILED = (False, True, ExitCode.RERUN_VALIDATION_FAILED)


def test_no_suspicion_means_one_run_per_step():
    loop = Loop(rerun_mode="validate_results", check_for_spiky_loss=True)
    for step in range(1, 4):
        losses, decision = loop.step()
        assert len(losses) == 1 and decision == CONTINUE
        assert loop.machine.current_iteration == step and loop.machine.state is RerunState.NOT_RUNNING_YET


def test_non_fatal_transient_error_reruns_in_place_and_continues(tmp_path):
    # Injection hits the first validation of each step: with the NaN check off, the spiky-loss check (non-fatal).
    loop = Loop(tmp_path, rerun_mode="validate_results", check_for_nan_in_loss=False, check_for_spiky_loss=True,
                error_injection_rate=1, error_injection_type="transient_error")
    for _ in range(3):
        losses, decision = loop.step()
        assert len(losses) == 2 and losses[0] == losses[1]  # the rerun replays RNG and microbatches
        assert decision == CONTINUE
    assert [d.diagnosis for d in loop.machine.diagnoses] == ["transient_error"] * 3
    kinds = [e["kind"] for e in read_events(loop.events_path)]
    assert kinds.count("rerun_diagnosis") == 3 and "rerun_exit_requested" not in kinds


def test_fatal_transient_error_exits_17_and_refuses_another_step(tmp_path):
    loop = Loop(tmp_path, rerun_mode="validate_results", error_injection_rate=1, error_injection_type="transient_error")
    losses, decision = loop.step()
    assert len(losses) == 2 and decision == VALIDATION_FAILED
    with pytest.raises(InvalidTransition, match="asked to exit with RERUN_VALIDATION_FAILED"):
        loop.machine.should_run_forward_backward(loop.data)
    with pytest.raises(RuntimeError, match="state_dict\\(\\) called in state 'will_exit_validation_failed'"):
        loop.machine.state_dict()
    (exit_event,) = [e for e in read_events(loop.events_path) if e["kind"] == "rerun_exit_requested"]
    assert exit_event["exit_code"] == 17 and exit_event["iteration"] == 1


@pytest.mark.parametrize("kind", ["persistent_error", "correct_result"])
def test_reproduced_result_asks_to_checkpoint_and_exit_16_with_the_state_before_the_step(kind):
    loop = Loop(rerun_mode="validate_results", error_injection_rate=1, error_injection_type=kind)
    before = torch.get_rng_state()
    losses, decision = loop.step()
    assert len(losses) == 2 and decision == RESUME_ELSEWHERE
    assert torch.equal(torch.get_rng_state(), before)  # restored for the exit checkpoint
    state = loop.machine.state_dict(loop.data)
    assert state["state"] == "will_rerun_from_checkpoint" and state["current_iteration"] == 1
    assert state["failed_call"]["injected"] == kind and state["failed_call"]["message"] == "NaN/Inf loss"
    assert state["failed_call"]["suspicious_device"] == ONE.to_dict()
    assert len(state["data_iterators"][0]["batches"]) == 1  # the step's microbatch travels with it
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["failed_call"]["injected"] == kind  # plain data only


def test_real_nan_reproduces_in_place(tmp_path):
    loop = Loop(tmp_path, rerun_mode="validate_results", nan_at=3)
    assert loop.step()[1] == CONTINUE and loop.step()[1] == CONTINUE
    losses, decision = loop.step()
    assert decision == RESUME_ELSEWHERE and all(v != v for v in losses)
    assert [(r.iteration, r.status, r.result) for r in read_rejected_results(str(tmp_path / "rejected.jsonl"))] == [
        (3, "initial_run", "nan"), (3, "first_rerun_reproducible", "nan"),
    ]


def test_megatron_style_validate_result_with_tensor_flag_and_tolerance():
    """rejection_func may return a tensor (torch.isnan); a difference within tolerance reproduces."""
    loop = Loop(rerun_mode="validate_results")
    runs = {"n": 0}

    def validate(loss):
        runs["n"] += 1
        drift = 1e-4 if runs["n"] % 2 == 0 else 0.0  # the rerun differs by ~1e-4 relative
        value = loss.detach() * (1 + drift)
        loop.machine.validate_result(value, torch.isnan, "never", tolerance=0.0)
        loop.machine.validate_result(value, lambda v: torch.tensor(True), "always", tolerance=1e-3, fatal=True)

    losses, decision = loop.step(validate)
    assert decision == RESUME_ELSEWHERE  # 1e-4 <= tolerance 1e-3: reproduced
    assert loop.machine.state_dict()["failed_call"]["message"] == "always"

    strict = Loop(rerun_mode="validate_results")
    runs["n"] = 0

    def validate_strict(loss):
        runs["n"] += 1
        value = loss.detach() * (1 + (1e-4 if runs["n"] % 2 == 0 else 0.0))
        strict.machine.validate_result(value, lambda v: torch.tensor(True), "always", tolerance=1e-6, fatal=False)

    assert strict.step(validate_strict)[1] == CONTINUE  # beyond tolerance: transient, not fatal
    assert [d.diagnosis for d in strict.machine.diagnoses] == ["transient_error"]


def test_protocol_misuse_is_refused_with_a_clear_error():
    loop = Loop(rerun_mode="validate_results")
    with pytest.raises(RuntimeError, match="call it inside the `while should_run_forward_backward"):
        loop.machine.validate_loss(torch.tensor(1.0))
    with pytest.raises(TypeError, match="wrap the data iterator in RerunDataIterator"):
        loop.machine.should_run_forward_backward(iter([1, 2]))
    assert loop.machine.should_run_forward_backward(loop.data)
    with pytest.raises(RuntimeError, match="call it after should_run_forward_backward\\(\\) returned False"):
        loop.machine.should_checkpoint_and_exit()
    with pytest.raises(RuntimeError, match="checkpoint between steps"):
        loop.machine.state_dict()
    with pytest.raises(RuntimeError, match="load between steps"):
        loop.machine.load_state_dict({})


def pending_state():
    loop = Loop(rerun_mode="validate_results", error_injection_rate=1, error_injection_type="persistent_error")
    assert loop.step()[1] == RESUME_ELSEWHERE
    return loop.machine.state_dict(loop.data)


@pytest.mark.parametrize("change, error", [
    (lambda s: s.update(format_version=9), "format_version=9: must be 1"),
    (lambda s: s.pop("spiky_loss"), "is missing \\['spiky_loss'\\]"),
    (lambda s: s.update(extra=1), "\\['extra'\\]: unknown keys"),
    (lambda s: s.update(mode="fast"), "mode='fast': not a rerun mode"),
    (lambda s: s.update(state="initial_run"), "state='initial_run': a checkpoint is only taken in"),
    (lambda s: s.update(current_iteration=-2), "current_iteration=-2: must be an integer >= 0"),
    (lambda s: s["failed_call"].update(iteration=5), "failed_call.iteration=5: must equal current_iteration"),
    (lambda s: s["failed_call"].update(injected="bitflip"), "failed_call.injected='bitflip'"),
    (lambda s: s["failed_call"].update(suspicious_device={"host": "h"}), "failed_call.suspicious_device="),
    (lambda s: s.update(saved_state=[]), "saved_state='list': must be a list of 1 snapshot"),
    (lambda s: s["saved_state"][0].update(torch_cpu="x"), "saved_state\\[0\\].torch_cpu: must be a uint8 tensor"),
    (lambda s: s["data_iterators"][0].update(drawn="3"), "data_iterators\\[0\\].drawn='3'"),
    (lambda s: s["spiky_loss"].update(window=[float("nan")]), "spiky_loss.window=\\[nan\\]"),
    (lambda s: s.update(state="not_running_yet"), "failed_call='set': only a will_rerun_from_checkpoint state"),
])
def test_load_state_dict_validates_everything_and_changes_nothing_on_error(change, error):
    state = pending_state()
    change(state)
    machine = Loop(rerun_mode="validate_results").machine
    with pytest.raises(RerunStateError, match=error):
        machine.load_state_dict(state)
    assert machine.state is RerunState.NOT_RUNNING_YET and machine.current_iteration == 0
    with pytest.raises(RerunStateError, match="must be a mapping"):
        machine.load_state_dict([1, 2])


def test_pending_rerun_needs_its_data_iterator():
    state = pending_state()
    machine = Loop(rerun_mode="validate_results").machine
    machine.load_state_dict(state)
    assert machine.state is RerunState.PENDING_RERUN_FROM_CHECKPOINT
    with pytest.raises(RerunStateError, match="holds state for 1 data iterator\\(s\\), but .* got 0"):
        machine.should_run_forward_backward(None)


def test_pending_rerun_loaded_with_stats_mode_or_abandon_is_dropped_and_the_step_renumbered(tmp_path):
    for config, abandon in (({"rerun_mode": "report_determinism_stats"}, False), ({"rerun_mode": "validate_results"}, True)):
        loop = Loop(tmp_path, **config)
        loop.machine.load_state_dict(pending_state(), abandon_pending_rerun=abandon)
        assert loop.machine.state is RerunState.NOT_RUNNING_YET and loop.machine.current_iteration == 0
        losses, decision = loop.step()
        assert decision == CONTINUE and loop.machine.current_iteration == 1
    statuses = [r.status for r in read_rejected_results(str(tmp_path / "rejected.jsonl"))]
    assert statuses == ["pending_rerun_abandoned"] * 2


def test_normal_checkpoint_round_trip_keeps_iteration_baseline_and_draw_count():
    loop = Loop(rerun_mode="validate_results", check_for_spiky_loss=True, spiky_loss_warmup=1, spiky_loss_min_samples=1)
    for _ in range(4):
        loop.step()
    state = loop.machine.state_dict(loop.data)
    assert state["failed_call"] is None and state["saved_state"] is None
    assert state["data_iterators"] == [{"format_version": 1, "drawn": 4, "batches": None}]
    assert len(state["spiky_loss"]["window"]) == 3
    resumed = Loop(rerun_mode="validate_results", check_for_spiky_loss=True, spiky_loss_warmup=1, spiky_loss_min_samples=1)
    resumed.machine.load_state_dict(state)
    resumed.step()
    assert resumed.machine.current_iteration == 5 and resumed.data.drawn == 5
    assert resumed.machine.state_dict()["spiky_loss"]["observed"] == 5


def test_disabled_mode_still_guards_fatal_checks_like_megatron():
    loop = Loop(rerun_mode="disabled", check_for_spiky_loss=True, spiky_loss_warmup=0, spiky_loss_min_samples=1, nan_at=2)
    assert loop.step()[1] == CONTINUE
    with pytest.raises(RerunValidationError, match="iteration 2: result nan rejected \\(NaN/Inf loss\\)"):
        loop.step()


def test_disabled_mode_does_no_extra_work():
    """Disabled: one forward-backward per step, no state captured, the data iterator untouched
    (nothing buffered for a replay), nothing to exit for. What it costs per step is measured
    next to a bare loop in bench/rerun.py, not here."""
    captures = []
    machine = RerunStateMachine(
        RerunConfig(rerun_mode="disabled"), device_identity=ONE, events=EventLog(None),
        state_adapters=[CallbackStateAdapter(lambda: captures.append(1), lambda s: None)],
    )

    class CountingIterator:
        reads = 0

        def __iter__(self):
            return self

        def __next__(self):
            self.reads += 1
            return torch.zeros(4)

    data, runs = CountingIterator(), 0
    for _ in range(100):
        while machine.should_run_forward_backward(data):
            runs += 1
            machine.validate_loss(torch.tensor(0.5))
        assert machine.should_checkpoint_and_exit() == (False, False, ExitCode.SUCCESS)
    assert (runs, data.reads, captures, machine.current_iteration) == (100, 0, [], 100)


class SyncCounter(torch.Tensor):
    """Counts reads of tensor values on the host (what would be device->host syncs on a GPU)."""

    reads = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in {"item", "__bool__", "tolist", "__float__", "__int__", "__index__"}:
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_checks_read_back_once_per_step():
    """The accelerator path (forced on CPU tensors): NaN and spike checks, then one read for the vote."""
    loop = Loop(rerun_mode="validate_results", check_for_spiky_loss=True, spiky_loss_warmup=0, spiky_loss_min_samples=1,
                tensor_ops_on_cpu=True)
    for _ in range(5):
        SyncCounter.reads = []
        losses, decision = loop.step(lambda loss: loop.machine.validate_loss(loss.detach().as_subclass(SyncCounter)))
        assert decision == CONTINUE and len(losses) == 1
        assert SyncCounter.reads == ["item"], SyncCounter.reads  # the vote, nothing else
    assert loop.machine.state_dict()["spiky_loss"]["observed"] == 5  # the checks did run


def test_determinism_stats_mode_reruns_every_step_and_reports():
    loop = Loop(rerun_mode="report_determinism_stats", determinism_stats_interval=3)
    for _ in range(3):
        losses, decision = loop.step()
        assert len(losses) == 2 and losses[0] == losses[1] and decision == CONTINUE
    report = loop.machine.last_determinism_report
    assert report["iteration"] == 3 and report["calls"]["NaN/Inf loss"]["count"] == 3
    assert report["calls"]["NaN/Inf loss"]["max"] == 0.0
    assert loop.machine.report_determinism_stats()["calls"] == {}  # nothing since the last report

    calls = {"n": 0}

    def validate_only_first_run(loss):
        calls["n"] += 1
        if calls["n"] == 1:
            loop.machine.validate_result(loss, torch.isnan, "only once")
        else:
            loop.machine.validate_result(loss, torch.isnan, "other")

    with pytest.raises(RuntimeError, match="has no counterpart in the initial run"):
        loop.step(validate_only_first_run)


def test_pipeline_style_list_of_iterators_replays_each_and_survives_the_exit_checkpoint():
    """A virtual-pipeline list of data iterators, with None for a stage without data (as Megatron passes)."""
    machine = RerunStateMachine(
        RerunConfig(rerun_mode="validate_results", error_injection_rate=1, error_injection_type="persistent_error"),
        device_identity=ONE, events=EventLog(None),
    )
    chunks = [RerunDataIterator(iter(range(0, 100))), None, RerunDataIterator(iter(range(100, 200)))]
    seen = []
    while machine.should_run_forward_backward(chunks):
        seen.append((next(chunks[0]), next(chunks[2]), next(chunks[2])))
        machine.validate_result(torch.tensor(1.0), torch.isnan, "value")
    assert seen == [(0, 100, 101)] * 2 and machine.should_checkpoint_and_exit() == RESUME_ELSEWHERE
    state = machine.state_dict(chunks)
    assert [s and s["batches"] for s in state["data_iterators"]] == [[0], None, [100, 101]]
    with pytest.raises(ValueError, match="pass the iterator\\(s\\) the step ran with"):
        machine.state_dict([RerunDataIterator([])])

    resumed = RerunStateMachine(RerunConfig(rerun_mode="validate_results"),
                                device_identity=DeviceIdentity("node-b", "cpu:0"), events=EventLog(None))
    resumed.load_state_dict(state)
    fresh = [RerunDataIterator(iter(range(1, 100))), None, RerunDataIterator(iter(range(102, 200)))]
    runs = []
    while resumed.should_run_forward_backward(fresh):
        runs.append((next(fresh[0]), next(fresh[2]), next(fresh[2])))
        resumed.validate_result(torch.tensor(1.0), torch.isnan, "value")
    assert runs == [(0, 100, 101)]  # replayed from the checkpoint, not from the fresh loaders
    assert resumed.should_checkpoint_and_exit() == CONTINUE
    assert [d.diagnosis for d in resumed.diagnoses] == ["persistent_error"]
    assert resumed.should_run_forward_backward(fresh) and (next(fresh[0]), next(fresh[2])) == (1, 102)


def test_a_tensor_flag_with_several_elements_rejects_if_any_does():
    for mode in ("validate_results", "disabled"):
        machine = RerunStateMachine(RerunConfig(rerun_mode=mode), device_identity=ONE, events=EventLog(None))
        data = RerunDataIterator(iter(range(10)))
        vector = torch.tensor([1.0, float("nan"), 2.0])
        if mode == "disabled":
            assert machine.should_run_forward_backward(data)
            with pytest.raises(RerunValidationError, match="tensor\\(shape=\\(3,\\), non_finite=1"):
                machine.validate_result(vector, torch.isnan, "grads")
            continue
        runs = 0
        while machine.should_run_forward_backward(data):
            runs += 1
            machine.validate_result(vector, torch.isnan, "grads")
        assert runs == 2 and machine.should_checkpoint_and_exit() == RESUME_ELSEWHERE


def test_a_rejected_call_the_rerun_never_reaches_did_not_reproduce():
    machine = RerunStateMachine(RerunConfig(rerun_mode="validate_results"), device_identity=ONE, events=EventLog(None))
    data = RerunDataIterator(iter(range(10)))
    runs = 0
    while machine.should_run_forward_backward(data):
        runs += 1
        if runs == 1:  # the rerun takes another control-flow path and never validates this value
            machine.validate_result(float("nan"), reject_non_finite, "only in the first run", fatal=False)
    assert runs == 2 and machine.should_checkpoint_and_exit() == CONTINUE
    assert [d.diagnosis for d in machine.diagnoses] == ["transient_error"]
