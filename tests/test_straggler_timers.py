"""Section timing with an injected clock. CUDA events cannot exist on this CPU-only
machine, so the CUDA read-back path is driven by FakeEvent (a stand-in for
torch.cuda.Event that reports the injected clock's times)."""

import pytest

from nvrx_core.straggler.timers import COMPUTE, WAIT, EventPool, TimingStore, wrap_callable
from harness.clock import FakeClock


class FakeEvent:
    """torch.cuda.Event stand-in: records the clock; elapsed_time in ms, like CUDA's."""

    created = 0

    def __init__(self, clock, gpu_factor):
        self.clock, self.gpu_factor, self.t, self.synced = clock, gpu_factor, None, False
        FakeEvent.created += 1

    def record(self):
        self.t = self.clock()

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3 * self.gpu_factor


def timed(store, clock, name, seconds, kind=COMPUTE):
    with store.section(name, kind):
        clock.advance(seconds)


def test_per_step_figures_are_sums_of_section_medians():
    clock = FakeClock(now=0.0)
    store = TimingStore(clock)
    for fwd_ms in (10, 11, 30):  # one outlier step
        timed(store, clock, "fwd", fwd_ms / 1e3)
        timed(store, clock, "bwd", 0.005)
        timed(store, clock, "sync", 0.002, kind=WAIT)
        store.end_step()
    times = store.summarize()
    assert times.steps == 3
    assert times.sections["fwd"].cpu_ms == pytest.approx(11.0)
    assert times.sections["fwd"].count == 3 and times.sections["fwd"].cuda_ms is None
    assert times.compute_ms == pytest.approx(16.0)  # 11 + 5: the 30 ms stall moves no median
    assert times.wait_ms == pytest.approx(2.0)
    assert times.sections["sync"].kind == WAIT


def test_stalls_in_different_sections_do_not_add_up():
    """Each step has one stalled section, in turn: every section's median stays normal, and
    so does the per-step figure (a median of per-step sums would be 30 ms)."""
    clock = FakeClock(now=0.0)
    store = TimingStore(clock)
    for step in range(6):
        timed(store, clock, "fwd", 0.025 if step % 2 == 0 else 0.005)
        timed(store, clock, "bwd", 0.025 if step % 2 == 1 else 0.005)
        store.end_step()
    times = store.summarize()
    assert times.sections["fwd"].cpu_ms == pytest.approx(15.0)  # median of 5, 25 (3 of each)
    assert times.compute_ms == pytest.approx(30.0)
    for _ in range(2):  # with most steps unstalled, the stalls vanish from the figures
        for _ in range(3):
            timed(store, clock, "fwd", 0.005)
            timed(store, clock, "bwd", 0.005)
            store.end_step()
    assert store.summarize().compute_ms == pytest.approx(10.0)


def test_wait_nested_in_compute_is_subtracted_and_nested_compute_not_double_counted():
    clock = FakeClock(now=0.0)
    store = TimingStore(clock)
    with store.section("backward"):
        clock.advance(0.004)
        timed(store, clock, "inner_compute", 0.001)
        timed(store, clock, "grad_allreduce", 0.003, kind=WAIT)
        clock.advance(0.002)
    times = store.summarize()
    assert times.sections["backward"].cpu_ms == pytest.approx(7.0)  # 10 ms section minus 3 ms of waiting
    assert times.sections["inner_compute"].cpu_ms == pytest.approx(1.0)
    assert times.compute_ms == pytest.approx(7.0)  # the nested compute section is not counted twice
    assert times.wait_ms == pytest.approx(3.0)
    assert times.steps == 1


def test_reentering_a_section_is_an_error_and_failed_entries_are_not_recorded():
    clock = FakeClock(now=0.0)
    store = TimingStore(clock)
    section = store.section("fwd")
    with pytest.raises(RuntimeError, match="entered again"):
        with section:
            with section:
                pass
    with pytest.raises(ZeroDivisionError):
        with store.section("fwd"):
            clock.advance(1.0)
            1 / 0
    assert store.summarize().sections == {}
    assert store.compute_depth == 0


def test_inactive_store_records_nothing():
    clock = FakeClock(now=0.0)
    store = TimingStore(clock)
    store.active = False
    timed(store, clock, "fwd", 0.01)
    store.end_step()
    times = store.summarize()
    assert times.steps == 0 and times.sections == {} and times.compute_ms is None


def test_section_names_and_kinds_are_checked():
    store = TimingStore(FakeClock(now=0.0))
    store.section("fwd")
    with pytest.raises(ValueError, match="is a 'compute' section, not 'wait'"):
        store.section("fwd", WAIT)
    with pytest.raises(ValueError, match="kind 'io'"):
        store.section("load", "io")
    with pytest.raises(ValueError, match="other than 'overall'"):
        store.section("overall")


def test_cuda_time_of_nested_waits_is_subtracted():
    clock = FakeClock(now=0.0)
    store = TimingStore(clock, EventPool(lambda: FakeEvent(clock, gpu_factor=1.0)))
    with store.section("backward"):
        clock.advance(0.006)
        timed(store, clock, "grad_allreduce", 0.004, kind=WAIT)
    times = store.summarize()
    assert times.sections["backward"].cuda_ms == pytest.approx(6.0)
    assert times.sections["grad_allreduce"].cuda_ms == pytest.approx(4.0)
    assert times.compute_ms == pytest.approx(6.0) and times.wait_ms == pytest.approx(4.0)


def test_cuda_events_read_back_at_report_time_and_reused():
    clock = FakeClock(now=0.0)
    pool = EventPool(lambda: FakeEvent(clock, gpu_factor=0.5))  # GPU busy half the wall time
    store = TimingStore(clock, pool)
    FakeEvent.created = 0
    for _ in range(4):
        timed(store, clock, "fwd", 0.010)
        timed(store, clock, "sync", 0.002, kind=WAIT)
        store.end_step()
    assert FakeEvent.created == 16  # 2 sections x 2 events x 4 steps
    times = store.summarize()
    assert times.sections["fwd"].cuda_ms == pytest.approx(5.0)
    assert times.sections["fwd"].ms == pytest.approx(5.0)  # scores use CUDA time
    assert times.sections["fwd"].cpu_ms == pytest.approx(10.0)
    assert times.compute_ms == pytest.approx(5.0)
    assert store.sections["fwd"].cuda[-1][1].synced
    store.reset()
    for _ in range(4):
        timed(store, clock, "fwd", 0.010)
        store.end_step()
    assert FakeEvent.created == 16  # the second interval reused the pooled events


def test_reset_keeps_section_objects_usable():
    clock = FakeClock(now=0.0)
    store = TimingStore(clock)
    fwd = store.section("fwd")
    timed(store, clock, "fwd", 0.01)
    store.reset()
    with fwd:
        clock.advance(0.02)
    assert store.summarize().sections["fwd"].cpu_ms == pytest.approx(20.0)


def test_wrap_callable_times_each_call_and_keeps_metadata():
    clock = FakeClock(now=0.0)
    store = TimingStore(clock)

    def forward(x):
        """doc"""
        clock.advance(0.003)
        return x * 2

    wrapped = wrap_callable(store.section("forward"), forward)
    assert wrapped(21) == 42 and wrapped(1) == 2
    assert wrapped.__doc__ == "doc" and wrapped.__name__ == "forward"
    times = store.summarize()
    assert times.sections["forward"].count == 2
    assert times.sections["forward"].cpu_ms == pytest.approx(3.0)
