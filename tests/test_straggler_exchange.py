"""What ranks exchange at a report: the payload bound agreed on beforehand must hold for
any payload, and rank 0's decision must survive its trip through a float vector."""

import json

from nvrx_core.straggler import RankStats, Report, StragglerConfig
from nvrx_core.straggler.exchange import (
    decision_length,
    local_payload,
    pack_decision,
    payload_bound,
    settings_of,
    unpack_decision,
)
from nvrx_core.straggler.scores import RollingBaseline
from nvrx_core.straggler.timers import COMPUTE, WAIT, IntervalTimes, SectionTimes

WIDEST = 2.2250738585072014e-308  # among the longest reprs of a positive float (23 characters)


def test_payload_never_exceeds_its_bound():
    names = ["fwd", "bwd", "optimizer.step", "ünïcode-section"]
    sections = {n: SectionTimes(COMPUTE, 10**9, WIDEST, WIDEST) for n in names}
    sections["allreduce"] = SectionTimes(WAIT, 3, 1.0, None)  # wait sections are not sent
    times = IntervalTimes(steps=10**15, compute_ms=WIDEST, wait_ms=WIDEST, sections=sections)
    baseline = RollingBaseline(window=3, warmup_reports=0)
    for scope in names + ["overall"]:
        baseline.update(scope, 1e-300, accepted=True)  # makes every individual score huge
    payload = local_payload(0, "node-with-a-long-name-0042", times, baseline)
    assert set(payload["individual"]) == set(names) | {"overall"}
    payload["settings"] = settings_of(StragglerConfig(report_time_interval=1e300, consecutive_reports=10**20))
    size = len(json.dumps(payload, separators=(",", ":")).encode())
    assert size <= payload_bound(0, "node-with-a-long-name-0042", names + ["allreduce"])
    del payload["settings"]
    assert len(json.dumps(payload, separators=(",", ":")).encode()) <= payload_bound(3, "node-with-a-long-name-0042", names)


def test_decision_round_trip():
    config = StragglerConfig(
        enabled=False,
        report_time_interval=0.25,
        relative_perf_threshold=0.9,
        individual_perf_threshold=0.65,
        consecutive_reports=3,
        stop_if_detected=True,
        num_scores_to_print=7,
    )
    stats = {0: RankStats(0, "n0", 5, 1.0, 0.1, {})}
    report = Report(4, 0, 6, True, stats, {}, {}, (), (), (2, 5), None, True, 1.0, 0.0)
    values = pack_decision(config, report, world_size=6)
    assert len(values) == decision_length(6)
    settings, has_report, stop, flagged = unpack_decision(values)
    assert settings == settings_of(config)
    assert all(type(settings[k]) is type(getattr(config, k)) for k in settings)
    assert has_report and stop and flagged == (2, 5)
    settings, has_report, stop, flagged = unpack_decision(pack_decision(StragglerConfig(), None, world_size=3))
    assert settings == settings_of(StragglerConfig()) and not has_report and not stop and flagged == ()
