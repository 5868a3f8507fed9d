"""Detector(exit_fn=None): the stop is decided and reported, the training loop acts on it.

Loops that checkpoint and exit themselves (Megatron-Bridge's asks its straggler manager
"should I stop?" each step) need the decision without the detector ending the process.
"""

import logging

from nvrx_core.events import STRAGGLER_FOUND, EventLog, read_events
from nvrx_core.straggler import Detector, StragglerConfig
from harness.clock import FakeClock


def _steps(detector, clock, n, fwd_s):
    reports = []
    for _ in range(n):
        with detector.section("fwd"):
            clock.now += fwd_s
        report = detector.step()
        if report is not None:
            reports.append(report)
    return reports


def _detector(tmp_path, clock, **kwargs):
    config = StragglerConfig(report_time_interval=1.0, warmup_reports=0, stop_if_detected=True, num_scores_to_print=0)
    events = EventLog(str(tmp_path / "events.jsonl"), rank=0)
    return Detector(config, events=events, clock=clock, timer=clock, exit_fn=None, **kwargs)


def test_stop_is_reported_and_the_process_goes_on(tmp_path):
    clock = FakeClock()
    detector = _detector(tmp_path, clock)
    _steps(detector, clock, 100, 0.01)
    reports = _steps(detector, clock, 200, 0.02)  # the rank doubles its step time: flagged
    stops = [r for r in reports if r.stop]
    assert stops and stops[0].flagged_ranks == (0,)
    found = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["kind"] == STRAGGLER_FOUND]
    assert found and all(e["action"] == "stop" for e in found)


def test_a_checkpoint_hook_still_runs_and_wrappers_stay(tmp_path):
    clock = FakeClock()
    saved = []
    detector = _detector(tmp_path, clock, checkpoint_hook=lambda report: saved.append(report.index))

    class Owner:
        def work(self):
            return 1

    owner = Owner()
    detector.wrap_attribute(owner, "work")
    _steps(detector, clock, 100, 0.01)
    _steps(detector, clock, 200, 0.02)
    assert saved  # called on the stop, no exit
    assert "work" in vars(owner)  # not closed: the loop may still time its checkpoint
    detector.close()
    assert "work" not in vars(owner)


def test_no_checkpoint_hook_warning_when_the_loop_stops(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        _detector(tmp_path, FakeClock())
    assert not [r for r in caplog.records if "checkpoint_hook" in r.getMessage()]
