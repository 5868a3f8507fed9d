"""Timeouts a rank is held to, and how they are learned from the rank's own behaviour.

Configured timeouts are deliberately loose (an hour for the first heartbeat). Once a job has
run a few iterations, each rank knows how long its heartbeats intervals and sections really
take; `calculate_and_set_timeouts()` turns the longest observation on any rank into
safety_factor x that, so the next hang is caught in seconds instead of an hour. Calculated
values are kept in the client's state (saved with the checkpoint as ft_state.json) and only
ever grow when merged, so a section not seen in this cycle keeps its earlier value.
"""

import dataclasses
import math
from typing import Dict, Mapping, Optional

from nvrx_core.config import ConfigError


@dataclasses.dataclass
class Timeouts:
    """Seconds allowed for each kind of wait; None means "not enforced"."""

    initial_heartbeat: Optional[float] = None
    heartbeat: Optional[float] = None
    sections: Dict[str, Optional[float]] = dataclasses.field(default_factory=dict)
    out_of_section: Optional[float] = None

    @classmethod
    def from_config(cls, cfg) -> "Timeouts":
        return cls(
            initial_heartbeat=cfg.initial_rank_heartbeat_timeout,
            heartbeat=cfg.rank_heartbeat_timeout,
            sections=dict(cfg.rank_section_timeouts),
            out_of_section=cfg.rank_out_of_section_timeout,
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping, source: str = "timeouts") -> "Timeouts":
        """Parse untrusted JSON (socket message, state file); raise ConfigError naming the field."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: expected an object, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"{source}: unknown fields {sorted(unknown)}")
        sections = data.get("sections") or {}
        if not isinstance(sections, Mapping):
            raise ConfigError(f"{source}.sections: expected an object")
        return cls(
            initial_heartbeat=_seconds(data.get("initial_heartbeat"), f"{source}.initial_heartbeat"),
            heartbeat=_seconds(data.get("heartbeat"), f"{source}.heartbeat"),
            sections={str(k): _seconds(v, f"{source}.sections[{k}]") for k, v in sections.items()},
            out_of_section=_seconds(data.get("out_of_section"), f"{source}.out_of_section"),
        )

    def overridden_by(self, other: "Timeouts") -> "Timeouts":
        """These timeouts with every value `other` has (not None) taking precedence."""
        sections = dict(self.sections)
        sections.update({k: v for k, v in other.sections.items() if v is not None})
        return Timeouts(
            initial_heartbeat=_first(other.initial_heartbeat, self.initial_heartbeat),
            heartbeat=_first(other.heartbeat, self.heartbeat),
            sections=sections,
            out_of_section=_first(other.out_of_section, self.out_of_section),
        )

    def merged_max(self, other: "Timeouts") -> "Timeouts":
        """Element-wise max, None counting as "unknown" (so a known value wins)."""
        names = set(self.sections) | set(other.sections)
        return Timeouts(
            initial_heartbeat=_max(self.initial_heartbeat, other.initial_heartbeat),
            heartbeat=_max(self.heartbeat, other.heartbeat),
            sections={n: _max(self.sections.get(n), other.sections.get(n)) for n in sorted(names)},
            out_of_section=_max(self.out_of_section, other.out_of_section),
        )


def _seconds(value, field: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{field}={value!r}: must be a positive number of seconds or null")
    return float(value)


def _first(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a if a is not None else b


def _max(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


class IntervalObserver:
    """Longest intervals a rank has actually taken, past its warm-up iterations.

    Called on the hot path (each heartbeat, each section start/end): a clock read and a
    few comparisons, nothing else.
    """

    def __init__(self, warmup_iterations: int):
        self.warmup = warmup_iterations
        self.start: Optional[float] = None
        self.first_heartbeat_delay: Optional[float] = None
        self.max_heartbeat_interval: Optional[float] = None
        self.max_section: Dict[str, float] = {}
        self.max_section_any_run: Dict[str, float] = {}
        """Including warm-up runs: the measure of a section that runs only once per process
        ('setup'), which warm-up would otherwise never let be learned."""
        self.max_out_of_section: Optional[float] = None
        self.open_sections: Dict[str, float] = {}
        self._heartbeats = 0
        self._last_heartbeat: Optional[float] = None
        self._section_runs: Dict[str, int] = {}
        self._last_section_end: Optional[float] = None
        self._gaps = 0

    def on_start(self, now: float) -> None:
        self.start = now

    def on_heartbeat(self, now: float) -> None:
        self._heartbeats += 1
        if self._last_heartbeat is None:
            if self.start is not None:
                self.first_heartbeat_delay = now - self.start
        elif self._heartbeats > self.warmup + 1:
            interval = now - self._last_heartbeat
            if self.max_heartbeat_interval is None or interval > self.max_heartbeat_interval:
                self.max_heartbeat_interval = interval
        self._last_heartbeat = now

    def on_section_start(self, name: str, now: float) -> None:
        if not self.open_sections and self._last_section_end is not None:
            self._gaps += 1
            if self._gaps > self.warmup:
                gap = now - self._last_section_end
                if self.max_out_of_section is None or gap > self.max_out_of_section:
                    self.max_out_of_section = gap
        self.open_sections[name] = now

    def on_section_end(self, name: str, now: float) -> None:
        started = self.open_sections.pop(name, None)
        if started is None:
            return
        runs = self._section_runs.get(name, 0) + 1
        self._section_runs[name] = runs
        duration = now - started
        if duration > self.max_section_any_run.get(name, -1.0):
            self.max_section_any_run[name] = duration
        if runs > self.warmup and duration > self.max_section.get(name, -1.0):
            self.max_section[name] = duration
        if not self.open_sections:
            self._last_section_end = now

    def observed(self, section_names) -> Timeouts:
        """The raw maxima (not yet scaled), None where nothing was observed. A section seen
        only in warm-up runs gives the longest of those (a longer timeout, never a shorter)."""
        return Timeouts(
            initial_heartbeat=self.first_heartbeat_delay,
            heartbeat=self.max_heartbeat_interval,
            sections={n: self.max_section.get(n, self.max_section_any_run.get(n)) for n in section_names},
            out_of_section=self.max_out_of_section,
        )


def scale(observed: Timeouts, factor: float, floor: float = 0.0) -> Timeouts:
    mul = lambda v: None if v is None else max(v * factor, floor)  # noqa: E731
    return Timeouts(
        initial_heartbeat=mul(observed.initial_heartbeat),
        heartbeat=mul(observed.heartbeat),
        sections={n: mul(v) for n, v in observed.sections.items()},
        out_of_section=mul(observed.out_of_section),
    )
