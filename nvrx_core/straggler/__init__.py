"""Straggler detection: find the rank everyone waits for, on CPU or GPU, at near-zero cost.

    from nvrx_core.straggler import Detector, StragglerConfig

    detector = Detector(StragglerConfig(report_time_interval=60))
    with detector.section("forward"):
        ...
    report = detector.step()   # a Report every report_time_interval seconds, else None

See docs/straggler.md.
"""

from nvrx_core.straggler.config import StragglerConfig
from nvrx_core.events import STRAGGLER_CLEARED
from nvrx_core.straggler.detector import Detector
from nvrx_core.straggler.report import INDIVIDUAL, RELATIVE, RankStats, Report, Straggler
from nvrx_core.straggler.timers import COMPUTE, OVERALL, WAIT

__all__ = [
    "COMPUTE",
    "Detector",
    "INDIVIDUAL",
    "OVERALL",
    "RELATIVE",
    "RankStats",
    "Report",
    "STRAGGLER_CLEARED",
    "Straggler",
    "StragglerConfig",
    "WAIT",
]
