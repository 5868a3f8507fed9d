"""StragglerConfig: every knob of straggler detection, validated where it is built.

Defaults are chosen so that a rank 30% slower than its peers is flagged (score 0.77 is
below the 0.8 thresholds) while the few-percent spread of healthy ranks is not.
"""

import dataclasses
from typing import Any, Optional

from nvrx_core.config import build, check, load_yaml_section

CUDA_TIMING_MODES = ("auto", "on", "off")

@dataclasses.dataclass(frozen=True)
class StragglerConfig:
    enabled: bool = True
    """Time sections and produce reports; False keeps only the cheap report schedule."""

    report_time_interval: float = 60.0
    """Seconds between reports (all ranks agree on the step where one is due)."""

    calc_relative_perf: bool = True
    """Score each rank against the fastest rank (best median / this rank's median)."""

    calc_individual_perf: bool = True
    """Score each rank against its own rolling baseline (baseline median / current median)."""

    relative_perf_threshold: float = 0.8
    """A relative score below this is bad (0.8: 25% slower than the fastest rank)."""

    individual_perf_threshold: float = 0.8
    """An individual score below this is bad (0.8: 25% slower than the rank's baseline)."""

    consecutive_reports: int = 2
    """Hysteresis: a score must be bad in this many consecutive reports to flag the rank."""

    warmup_reports: int = 1
    """Reports at the start (compilation, cache warm-up) left out of the individual baseline."""

    baseline_window: int = 10
    """Reports in the rolling individual baseline (its median is the reference)."""

    profiling_interval: int = 1
    """Time sections only in every N-th step (1 = every step)."""

    schedule_checks_per_interval: int = 2
    """About how many "is a report due" agreements (one tiny all_reduce each) to make per
    report interval; more make reports more punctual when step times change, fewer cost
    less. With 2, a report is late by at most half an interval times the step slowdown."""

    num_scores_to_print: int = 5
    """Rows of best and of worst ranks in the logged table (0: log only when flagged)."""

    stop_if_detected: bool = False
    """On a flagged straggler: run the checkpoint hook, then exit with STRAGGLER_STOP (19)."""

    gather_on_rank0: bool = True
    """True: rank 0 gathers and scores; False: every rank gets the full report."""

    cuda_timing: str = "auto"
    """CUDA-event timing of sections: auto (on with an NCCL process group), on, off."""

    control_file: Optional[str] = None
    """YAML/JSON file re-read by rank 0 at report time to change settings while running."""

    node_name: Optional[str] = None
    """Node name shown in reports; None: the host name."""

    enable_logging: bool = True
    """Log the report table (events are emitted either way)."""

    logger_name: str = "nvrx.straggler"

    def __post_init__(self):
        for name in (
            "enabled",
            "calc_relative_perf",
            "calc_individual_perf",
            "stop_if_detected",
            "gather_on_rank0",
            "enable_logging",
        ):
            value = getattr(self, name)
            check(isinstance(value, bool), name, value, "must be true or false")
        interval = self.report_time_interval
        check(
            isinstance(interval, (int, float)) and not isinstance(interval, bool) and interval > 0,
            "report_time_interval",
            interval,
            "must be a number of seconds > 0",
        )
        for name in ("relative_perf_threshold", "individual_perf_threshold"):
            value = getattr(self, name)
            check(
                isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1,
                name,
                value,
                "must be a score in (0, 1]",
            )
        for name, low in (
            ("consecutive_reports", 1),
            ("warmup_reports", 0),
            ("baseline_window", 1),
            ("profiling_interval", 1),
            ("schedule_checks_per_interval", 1),
            ("num_scores_to_print", 0),
        ):
            value = getattr(self, name)
            check(
                isinstance(value, int) and not isinstance(value, bool) and value >= low,
                name,
                value,
                f"must be an integer >= {low}",
            )
        check(
            self.calc_relative_perf or self.calc_individual_perf,
            "calc_relative_perf",
            self.calc_relative_perf,
            "at least one of calc_relative_perf / calc_individual_perf must be true",
        )
        check(
            self.cuda_timing in CUDA_TIMING_MODES,
            "cuda_timing",
            self.cuda_timing,
            f"must be one of {', '.join(CUDA_TIMING_MODES)}",
        )
        for name in ("control_file", "node_name"):
            value = getattr(self, name)
            valid = value is None or (isinstance(value, str) and value)
            check(valid, name, value, "must be a non-empty string or null")
        name = self.logger_name
        check(isinstance(name, str) and name, "logger_name", name, "must be a non-empty string")

    @classmethod
    def from_yaml(cls, path: str, section: str = "straggler", **overrides: Any) -> "StragglerConfig":
        """defaults < the YAML file's `straggler:` section < overrides (e.g. parsed CLI flags)."""
        return build(cls, load_yaml_section(path, section), overrides, source=f"{path}:{section}")
