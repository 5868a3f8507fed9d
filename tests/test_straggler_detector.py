"""Detector in a world of one process, driven by injected clocks: schedule, individual
scores, hysteresis, runtime control, events, the stop path, wrapping and the table.
(Multi-rank behaviour is in test_straggler_dist.py.)"""

import logging

import pytest
import torch

from nvrx_core.events import STRAGGLER_FOUND, EventLog, read_events
from nvrx_core.exit_codes import ExitCode
from nvrx_core.straggler import (
    INDIVIDUAL,
    OVERALL,
    RELATIVE,
    STRAGGLER_CLEARED,
    Detector,
    RankStats,
    Report,
    Straggler,
    StragglerConfig,
)
from harness.clock import FakeClock


def make(tmp_path, clock, **config):
    config.setdefault("num_scores_to_print", 0)
    events = EventLog(str(tmp_path / "events.jsonl"), rank=0)
    return Detector(StragglerConfig(**config), events=events, clock=clock, timer=clock)


def run_steps(detector, clock, n, fwd_s=0.010, other_s=0.0):
    reports = []
    for _ in range(n):
        with detector.section("fwd"):
            clock.now += fwd_s
        clock.now += other_s
        report = detector.step()
        if report is not None:
            reports.append((detector.report_count, report))
    return reports


def test_reports_on_time_with_few_schedule_checks(tmp_path):
    clock = FakeClock()
    detector = make(tmp_path, clock, report_time_interval=1.0, schedule_checks_per_interval=4)
    checks = []
    real = detector._coll.all_reduce_max
    detector._coll.all_reduce_max = lambda values: checks.append(values) or real(values)
    reports = run_steps(detector, clock, 1000)  # 10 s of 10 ms steps
    assert len(reports) == 10
    for _, report in reports:
        assert report.interval_s == pytest.approx(1.0, abs=0.011)  # within one step of due
    assert len(checks) <= 10 * 6  # a handful of tiny all_reduces per report, not one per step


def test_step_time_change_delays_a_report_by_a_fraction_of_the_interval(tmp_path):
    clock = FakeClock()
    detector = make(tmp_path, clock, report_time_interval=1.0, schedule_checks_per_interval=4)
    run_steps(detector, clock, 150)  # one report, schedule learned at 10 ms per step
    reports = run_steps(detector, clock, 300, fwd_s=0.030)  # steps become 3x slower
    assert reports and reports[0][1].interval_s < 1.0 + 3 * 0.25


def test_individual_slowdown_flagged_after_consecutive_reports_then_cleared(tmp_path):
    clock = FakeClock()
    detector = make(tmp_path, clock, report_time_interval=1.0, warmup_reports=1, consecutive_reports=2)
    reports = run_steps(detector, clock, 300)  # reports 1-3 at 10 ms: warm-up + baseline
    assert [r.stragglers for _, r in reports] == [(), (), ()]
    assert reports[-1][1].individual["fwd"][0] == pytest.approx(1.0)
    slow = run_steps(detector, clock, 100, fwd_s=0.020)
    slow += run_steps(detector, clock, 50, fwd_s=0.020)
    first, second = slow[0][1], slow[1][1]
    assert first.individual["fwd"][0] == pytest.approx(0.5, abs=0.01)
    assert first.stragglers == () and {(s.score_kind, s.scope) for s in first.suspects} == {
        (INDIVIDUAL, "fwd"),
        (INDIVIDUAL, OVERALL),
    }
    assert {(s.rank, s.score_kind, s.scope, s.consecutive) for s in second.stragglers} == {
        (0, INDIVIDUAL, "fwd", 2),
        (0, INDIVIDUAL, OVERALL, 2),
    }
    assert second.flagged_ranks == (0,) and not second.stop
    assert second.relative["fwd"][0] == 1.0  # alone in its world: relative cannot see it
    recovered = run_steps(detector, clock, 200)
    assert recovered[-1][1].stragglers == ()  # the slow reports never entered the baseline
    events = read_events(str(tmp_path / "events.jsonl"))
    found = [e for e in events if e["kind"] == STRAGGLER_FOUND]
    cleared = [e for e in events if e["kind"] == STRAGGLER_CLEARED]
    assert {(e["scope"], e["score_kind"], e["straggler_rank"]) for e in found} == {
        ("fwd", INDIVIDUAL, 0),
        (OVERALL, INDIVIDUAL, 0),
    }
    assert len(found) == 2  # once when flagged, not at every report while flagged
    assert {e["scope"] for e in cleared} == {"fwd", OVERALL}


def test_stop_runs_checkpoint_hook_then_exits_19(tmp_path):
    clock = FakeClock()
    calls = []
    events = EventLog(str(tmp_path / "events.jsonl"), rank=0)
    detector = Detector(
        StragglerConfig(report_time_interval=1.0, warmup_reports=0, stop_if_detected=True, num_scores_to_print=0),
        events=events,
        clock=clock,
        timer=clock,
        checkpoint_hook=lambda report: calls.append(("checkpoint", report.index, report.flagged_ranks)),
        exit_fn=lambda code: calls.append(("exit", code)),
    )
    run_steps(detector, clock, 100)
    run_steps(detector, clock, 200, fwd_s=0.02)
    assert calls[:2] == [("checkpoint", 3, (0,)), ("exit", int(ExitCode.STRAGGLER_STOP))]
    found = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["kind"] == STRAGGLER_FOUND]
    assert found and all(e["action"] == "stop" for e in found)


def test_stop_without_exit_fn_raises_system_exit_19(tmp_path):
    clock = FakeClock()
    detector = Detector(
        StragglerConfig(report_time_interval=1.0, warmup_reports=0, stop_if_detected=True, num_scores_to_print=0),
        events=EventLog(None),
        clock=clock,
        timer=clock,
        checkpoint_hook=lambda report: None,
    )
    run_steps(detector, clock, 100)
    with pytest.raises(SystemExit) as e:
        run_steps(detector, clock, 200, fwd_s=0.02)
    assert e.value.code == 19


def test_control_file_disables_changes_and_survives_bad_content(tmp_path, caplog):
    clock = FakeClock()
    control = tmp_path / "control.yaml"
    detector = make(tmp_path, clock, report_time_interval=1.0, control_file=str(control))
    assert run_steps(detector, clock, 100)[0][1] is not None
    control.write_text("enabled: false\n")
    run_steps(detector, clock, 100)  # read at this report: no report from now on
    assert detector.config.enabled is False
    fwd = detector.section("fwd")
    assert run_steps(detector, clock, 300) == []  # reports skipped while disabled...
    assert detector.report_count == 5  # ...but the schedule kept running
    assert fwd.cpu_s == []  # and sections cost nothing
    control.write_text("enabled: true\nrelative_perf_threshold: 0.9\nconsecutive_reports: 3\n")
    reports = run_steps(detector, clock, 200)
    assert detector.config.relative_perf_threshold == 0.9 and detector.config.consecutive_reports == 3
    assert len(reports) == 1  # the report that read the file had nothing timed: None
    with caplog.at_level(logging.ERROR, logger="nvrx.straggler"):
        control.write_text("relative_perf_threshold: 7\n")
        run_steps(detector, clock, 100)
        control.write_text("report_every: 3\n")
        run_steps(detector, clock, 100)
        control.write_text("enabled: [unclosed\n")
        run_steps(detector, clock, 100)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("relative_perf_threshold=7" in m and "(0, 1]" in m for m in errors)
    assert any("unknown setting(s) report_every" in m for m in errors)
    assert len(errors) == 3
    assert detector.config.relative_perf_threshold == 0.9  # the last good settings stay
    control.unlink()
    run_steps(detector, clock, 100)
    assert detector.config == StragglerConfig(
        report_time_interval=1.0, control_file=str(control), num_scores_to_print=0
    )


def test_profiling_interval_times_every_nth_step(tmp_path):
    clock = FakeClock()
    detector = make(tmp_path, clock, report_time_interval=1.0, profiling_interval=4)
    reports = run_steps(detector, clock, 100)
    assert reports[0][1].ranks[0].steps == pytest.approx(25, abs=1)


def test_wrap_and_wrap_attribute_are_undone_by_close(tmp_path):
    clock = FakeClock()
    detector = make(tmp_path, clock, report_time_interval=1.0)

    class Model(torch.nn.Module):
        def forward(self, x):
            clock.now += 0.004
            return x + 1

    model = Model()
    detector.wrap_attribute(model, "forward", name="model_fwd")

    @detector.wrap(name="loss")
    def loss_fn(y):
        clock.now += 0.001
        return y.sum()

    opt_step = detector.wrap(lambda: None, name="opt", kind="wait")
    reports = []
    for _ in range(250):  # 5 ms steps: one report after 1 s
        loss_fn(model(torch.ones(2)))
        opt_step()
        reports.append(detector.step())
    (report,) = [r for r in reports if r is not None]
    assert report.ranks[0].section_ms == pytest.approx({"model_fwd": 4.0, "loss": 1.0})
    assert "forward" in vars(model)
    detector.close()
    assert "forward" not in vars(model) and model(torch.ones(1)).item() == 2.0


def test_cuda_timing_on_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA")
    with pytest.raises(RuntimeError, match="cuda_timing='on' but CUDA is not available"):
        Detector(StragglerConfig(cuda_timing="on"), events=EventLog(None))
    assert Detector(StragglerConfig(cuda_timing="auto"), events=EventLog(None))._store.event_pool is None


def test_table_shows_worst_and_best_ranks_with_node_names():
    ranks = {r: RankStats(r, f"node{r // 4:02d}", 100, 10.0 + r / 10, 1.0, {"fwd": 6.0 + r / 10}) for r in range(12)}
    ranks[7] = RankStats(7, "node01", 100, 20.0, 0.1, {"fwd": 16.0})
    relative = {OVERALL: {r: 10.0 / ranks[r].compute_ms for r in ranks}, "fwd": {r: 6.0 / ranks[r].section_ms["fwd"] for r in ranks}}
    flagged = Straggler(7, "node01", RELATIVE, "fwd", relative["fwd"][7], 0.8, 2)
    report = Report(3, 0, 12, True, ranks, relative, {}, (flagged,), (), (7,), 7, False, 60.0, 0.01)
    text = report.table(rows=2)
    lines = text.splitlines()
    assert "FLAGGED: rank 7 (node01) relative fwd 0.38 x2" in lines[0]
    assert "others waited for rank 7" in lines[0]
    assert lines[1].strip() == "worst 2:" and lines[5].strip() == "best 2:"
    assert lines[3].split()[:2] == ["7", "node01"] and lines[4].split()[:2] == ["11", "node02"]
    assert lines[3].split()[-2:] == ["fwd", "0.38"]
    assert lines[7].split()[:2] == ["0", "node00"]
    assert len(lines) == 9
    assert report.rank_to_node[11] == "node02"
