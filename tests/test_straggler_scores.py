"""Scores, rolling baseline and hysteresis (pure logic, no processes)."""

import pytest

from nvrx_core.straggler.scores import Hysteresis, RollingBaseline, relative_scores


def test_relative_scores_are_one_over_k():
    scores = relative_scores({0: 10.0, 1: 10.0, 2: 13.0, 3: 20.0})
    assert scores == pytest.approx({0: 1.0, 1: 1.0, 2: 1 / 1.3, 3: 0.5})


def test_relative_scores_skip_missing_and_zero_times():
    assert relative_scores({0: None, 1: 0.0, 2: 4.0, 3: 8.0}) == {2: 1.0, 3: 0.5}
    assert relative_scores({}) == {}
    assert relative_scores({0: None}) == {}


def test_baseline_excludes_warmup_and_has_no_score_before_it():
    baseline = RollingBaseline(window=3, warmup_reports=2)
    assert baseline.score("fwd", 10.0) is None
    baseline.update("fwd", 50.0, accepted=True)  # warm-up: compilation
    baseline.update("fwd", 40.0, accepted=True)  # warm-up
    assert baseline.score("fwd", 10.0) is None
    baseline.update("fwd", 10.0, accepted=True)
    assert baseline.score("fwd", 10.0) == pytest.approx(1.0)
    assert baseline.score("fwd", 20.0) == pytest.approx(0.5)
    assert baseline.score("bwd", 10.0) is None  # every scope has its own warm-up


def test_baseline_is_median_of_the_faster_half_and_rolls():
    baseline = RollingBaseline(window=4, warmup_reports=0)
    for ms in (8.0, 10.0, 10.0, 13.0):
        baseline.update("s", ms, accepted=True)
    assert baseline.score("s", 9.0) == pytest.approx(1.0)  # faster half (8, 10): a lucky 8 ms is not the bar
    slow_start = RollingBaseline(window=4, warmup_reports=0)
    for ms in (13.0, 10.0):  # a slow (busy host) report, then a normal one
        slow_start.update("s", ms, accepted=True)
    assert slow_start.score("s", 13.0) == pytest.approx(10 / 13)  # a 30% slowdown still shows
    for ms in (12.0, 12.0, 12.0):
        baseline.update("s", ms, accepted=True)
    assert baseline.score("s", 12.0) == pytest.approx(1.0)  # the window rolled: 8 and 10 dropped


def test_baseline_ignores_rejected_reports():
    baseline = RollingBaseline(window=5, warmup_reports=0)
    baseline.update("s", 10.0, accepted=True)
    for _ in range(10):
        baseline.update("s", 20.0, accepted=False)  # a slow rank must not move its own bar
    assert baseline.score("s", 20.0) == pytest.approx(0.5)
    baseline.update("s", 0.0, accepted=True)  # no time measured: ignored
    assert baseline.score("s", None) is None
    baseline.reset()
    assert baseline.score("s", 10.0) is None


def test_hysteresis_needs_consecutive_bad_reports():
    h = Hysteresis(required=2)
    assert h.update([(3, "relative", "fwd")]) == {(3, "relative", "fwd"): 1}
    assert h.flagged() == {}
    h.update([(3, "relative", "fwd"), (1, "relative", "fwd")])
    assert h.flagged() == {(3, "relative", "fwd"): 2}
    h.update([(1, "relative", "fwd")])  # rank 3 recovered, its streak ends
    assert h.flagged() == {(1, "relative", "fwd"): 2}
    h.update([])
    assert h.flagged() == {}
    h.required = 1
    h.update([(0, "individual", "overall")])
    assert h.flagged() == {(0, "individual", "overall"): 1}
