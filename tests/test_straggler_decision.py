"""decide(): scoring gathered payloads into flags (pure logic, no processes)."""

import pytest

from nvrx_core.straggler import INDIVIDUAL, OVERALL, RELATIVE, StragglerConfig
from nvrx_core.straggler.decision import decide
from nvrx_core.straggler.scores import Hysteresis


def payload(rank, fwd_ms, individual=None):
    p = {"rank": rank, "node": f"n{rank // 2}", "steps": 50, "compute_ms": fwd_ms, "wait_ms": 1.0}
    p["sections"] = {"fwd": fwd_ms}
    if individual is not None:
        p["individual"] = {"fwd": individual, OVERALL: individual}
    return p


def run(payload_rounds, **config):
    cfg = StragglerConfig(**config)
    hysteresis = Hysteresis(cfg.consecutive_reports)
    reports = []
    for i, payloads in enumerate(payload_rounds, start=1):
        reports.append(
            decide(payloads, cfg, hysteresis, index=i, rank=0, interval_s=1.0, started=0.0, clock=lambda: 0.0)
        )
    return reports


def flags(report):
    return {(s.rank, s.score_kind, s.scope) for s in report.stragglers}


def test_relative_and_individual_flags_after_two_reports():
    rounds = [[payload(0, 10.0, 1.0), payload(1, 10.0, 1.0), payload(2, 13.0, 0.77)]] * 2
    first, second = run(rounds)
    assert first.stragglers == () and {(s.rank, s.score_kind) for s in first.suspects} == {(2, RELATIVE), (2, INDIVIDUAL)}
    assert flags(second) == {(2, RELATIVE, "fwd"), (2, RELATIVE, OVERALL), (2, INDIVIDUAL, "fwd"), (2, INDIVIDUAL, OVERALL)}
    assert second.relative["fwd"][2] == pytest.approx(10 / 13)
    assert second.flagged_ranks == (2,) and second.rank_to_node[2] == "n1" and not second.stop


def test_job_wide_slowdown_flags_nobody_but_a_rank_slowed_further_is_flagged():
    everyone = [[payload(r, 15.0, 0.65) for r in range(4)]] * 3
    reports = run(everyone)
    assert all(r.stragglers == () and r.suspects == () for r in reports)
    assert reports[-1].job_individual[OVERALL] == pytest.approx(0.65)
    assert "whole job at 0.65 of its baseline" in reports[-1].table(2)
    worse = [[payload(0, 15.0, 0.66), payload(1, 15.0, 0.65), payload(2, 15.0, 0.65), payload(3, 20.0, 0.49)]] * 2
    last = run(worse, calc_relative_perf=False)[-1]
    assert flags(last) == {(3, INDIVIDUAL, "fwd"), (3, INDIVIDUAL, OVERALL)}
    (entry,) = [s for s in last.stragglers if s.scope == OVERALL]
    assert entry.threshold == pytest.approx(0.8 * 0.66)  # the threshold it fell below, job-scaled


def test_stop_decision_and_ranks_without_data():
    rounds = [[payload(0, 10.0), {"rank": 1}, payload(2, 25.0)]] * 2
    last = run(rounds, stop_if_detected=True)[-1]
    assert set(last.ranks) == {0, 2} and last.world_size == 3
    assert last.flagged_ranks == (2,) and last.stop


def with_wait(p, wait_ms):
    return dict(p, wait_ms=wait_ms)


def test_waited_for_names_the_least_waiting_rank_only_when_the_others_clearly_wait():
    # Ranks 0-2 wait ~9 ms a step for rank 3 (10 ms of compute each): rank 3 is named.
    waits = [9.0, 9.5, 8.8, 0.4]
    (report,) = run([[with_wait(payload(r, 10.0), w) for r, w in enumerate(waits)]])
    assert report.waited_for == 3
    # Waits that differ by less than 10 % of the median compute (1 ms) are a balanced job's noise.
    (balanced,) = run([[with_wait(payload(r, 10.0), w) for r, w in enumerate([1.2, 0.9, 1.5, 0.6])]])
    assert balanced.waited_for is None
    # A single rank reporting a wait names nobody: there is nobody to compare with.
    (alone,) = run([[with_wait(payload(0, 10.0), 0.1), {"rank": 1}]])
    assert alone.waited_for is None
