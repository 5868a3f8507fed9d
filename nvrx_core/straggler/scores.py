"""Performance scores and the state that keeps them from crying wolf.

A score is reference time / current time: 1.0 is as fast as the reference, 0.5 twice as
slow. Relative scores take the fastest rank as the reference; individual scores take the
rank's own rolling baseline, so a rank that is slow from the start is caught by the first
and a rank that degrades over time by the second.
"""

import collections
import statistics
from typing import Deque, Dict, Hashable, Iterable, Mapping, Optional


def relative_scores(times: Mapping[int, float]) -> Dict[int, float]:
    """Per rank: fastest rank's time / this rank's time. Ranks without a positive time are left out."""
    positive = {rank: t for rank, t in times.items() if t is not None and t > 0}
    if not positive:
        return {}
    best = min(positive.values())
    return {rank: best / t for rank, t in positive.items()}


class RollingBaseline:
    """Per-scope reference time of one rank, from its last `window` accepted reports.

    The reference is the median of the faster half of those report medians. Interference
    (a busy host, a noisy neighbour, a throttled clock) only ever makes a report slower,
    so the reference leans to the fast side: one slow report at the start cannot hide a
    later slowdown, and one lucky report cannot set a bar the rank never meets again (it
    is averaged with the next fastest). Warm-up reports of each scope are never accepted
    (compilation, cold caches); reports whose individual score was bad are not accepted
    either, so a rank that slows down does not drag its own reference with it.
    """

    def __init__(self, window: int, warmup_reports: int):
        self._window = window
        self._warmup = warmup_reports
        self._seen: Dict[str, int] = collections.defaultdict(int)
        self._history: Dict[str, Deque[float]] = {}

    def score(self, scope: str, current_ms: Optional[float]) -> Optional[float]:
        """baseline / current, or None while the scope has no baseline yet."""
        history = self._history.get(scope)
        if not history or current_ms is None or current_ms <= 0:
            return None
        ordered = sorted(history)
        return statistics.median(ordered[: (len(ordered) + 1) // 2]) / current_ms

    def update(self, scope: str, current_ms: Optional[float], accepted: bool) -> None:
        """Feed one report's time; it joins the baseline after warm-up if `accepted`."""
        if current_ms is None or current_ms <= 0:
            return
        self._seen[scope] += 1
        if self._seen[scope] <= self._warmup or not accepted:
            return
        history = self._history.get(scope)
        if history is None:
            history = self._history[scope] = collections.deque(maxlen=self._window)
        history.append(current_ms)

    def reset(self) -> None:
        """Forget every baseline (e.g. after an intended change of the workload)."""
        self._seen.clear()
        self._history.clear()


class Hysteresis:
    """Counts consecutive bad reports per key; a key is flagged after `required` in a row."""

    def __init__(self, required: int):
        self.required = required
        self._streaks: Dict[Hashable, int] = {}

    def update(self, bad: Iterable[Hashable]) -> Dict[Hashable, int]:
        """Record one report's bad keys; good keys' streaks end. Returns the current streaks."""
        self._streaks = {key: self._streaks.get(key, 0) + 1 for key in set(bad)}
        return dict(self._streaks)

    def flagged(self) -> Dict[Hashable, int]:
        """Keys bad for at least `required` consecutive reports, with their streak length."""
        return {key: n for key, n in self._streaks.items() if n >= self.required}
