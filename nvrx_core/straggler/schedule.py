"""When to report: every rank must make a report at the same step, decided cheaply.

step() only counts down to the next check. A check is one all_reduce (MAX) of a few
floats: "is the interval over on any rank" and, for either answer, how many steps to the
next check (negated, so MAX yields the smallest proposal). Checks aim at the due time,
sized from the measured step time, and are at most 1/checks_per_interval of the interval
apart, so a change of step time delays a report by only a fraction of the interval.
"""

from typing import Callable, List, Sequence

MAX_STEPS_BETWEEN_CHECKS = 100_000


class ReportSchedule:
    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self.last_report = self._last_check = clock()
        self._check_every = self._steps_to_check = 1

    def count_step(self) -> bool:
        """Count one step; True when it is a check step (the same step on every rank)."""
        self._steps_to_check -= 1
        return self._steps_to_check <= 0

    def proposal(self, interval: float, checks_per_interval: int) -> List[float]:
        """This rank's [due, -steps to the next check if reporting now, -steps if not]."""
        now = self._clock()
        step_s = max((now - self._last_check) / self._check_every, 1e-9)
        self._last_check = now
        gap = interval / checks_per_interval
        left = interval - (now - self.last_report)

        def steps_for(seconds: float) -> float:
            return -float(min(max(round(seconds / step_s), 1), MAX_STEPS_BETWEEN_CHECKS))

        due = left <= step_s / 2  # the next step would overshoot more than this one falls short
        return [1.0 if due else 0.0, steps_for(min(interval, gap)), steps_for(min(left, gap))]

    def agree(self, agreed: Sequence[float]) -> bool:
        """Adopt the all-reduced proposals; True if a report is due now."""
        report_now = agreed[0] > 0
        self._check_every = self._steps_to_check = int(-(agreed[1] if report_now else agreed[2]))
        return report_now

    def start_report(self) -> float:
        """Mark the start of a report; returns the seconds since the previous one."""
        now = self._clock()
        interval_s, self.last_report = now - self.last_report, now
        return interval_s
