"""Section timing between two reports: cheap on the hot path, summarized at report time.

Entering and leaving a section costs two clock reads and a list append. On CUDA a section
also records two events on the current stream; they are read back (one synchronize per
section) only when a report is made, so the training loop never waits for the GPU.

Compute is kept apart from waiting: sections of kind "wait" (a collective, a barrier) are
summed separately, and the time of a wait nested inside a compute section is subtracted
from that section's entry. The rank the others wait for is the one whose compute is slow
and whose wait is short.

Per-step figures are sums of per-section medians (times entries per step), not medians of
per-step sums: one stall in some step of some section moves a median of sums, but not a
median of each section.
"""

import dataclasses
import functools
import statistics
from typing import Any, Callable, Dict, List, Optional, Tuple

COMPUTE = "compute"
WAIT = "wait"
SECTION_KINDS = (COMPUTE, WAIT)
OVERALL = "overall"
"""Scope name of the per-step total; reserved, no section may use it."""


class EventPool:
    """Reuses CUDA timing events across report intervals so the hot path does not allocate."""

    def __init__(self, factory: Callable[[], Any]):
        self._factory = factory
        self._free: List[Any] = []

    def acquire(self) -> Any:
        return self._free.pop() if self._free else self._factory()

    def release(self, events) -> None:
        self._free.extend(events)


@dataclasses.dataclass(frozen=True)
class SectionTimes:
    kind: str
    count: int
    cpu_ms: float
    """Median wall time of one entry (less the waits nested in it)."""
    cuda_ms: Optional[float]
    """Median CUDA-event time of one entry (less nested waits); None when not on CUDA."""
    top_level: int = 0
    """Entries not nested in another compute section."""

    @property
    def ms(self) -> float:
        """The time scores use: CUDA time where measured (it excludes host launch jitter)."""
        return self.cuda_ms if self.cuda_ms is not None else self.cpu_ms


@dataclasses.dataclass(frozen=True)
class IntervalTimes:
    steps: int
    """Steps in which a section was timed."""
    compute_ms: Optional[float]
    """Per-step compute: sum over top-level compute sections of median x entries per step."""
    wait_ms: Optional[float]
    """Per-step waiting: sum over wait sections of median x entries per step."""
    sections: Dict[str, SectionTimes]


# A CUDA sample: (start event, end event, wait event pairs nested in this entry).
CudaSample = Tuple[Any, Any, Tuple[Tuple[Any, Any], ...]]


class Section:
    """A named timed region; reusable, not re-entrant, used from the training thread."""

    __slots__ = ("name", "kind", "_store", "_t0", "_waited0", "_nested0", "_start_event", "cpu_s", "cuda", "top_level")

    def __init__(self, name: str, kind: str, store: "TimingStore"):
        self.name = name
        self.kind = kind
        self._store = store
        self._t0: Optional[float] = None
        self._waited0 = 0.0
        self._nested0 = 0
        self._start_event = None
        self.cpu_s: List[float] = []
        self.cuda: List[CudaSample] = []
        self.top_level = 0

    def __enter__(self) -> "Section":
        store = self._store
        if not store.active:
            return self
        if self._t0 is not None:
            raise RuntimeError(
                f"straggler section {self.name!r} entered again before it exited "
                "(a section cannot nest in itself or be used from two threads at once)"
            )
        if self.kind is COMPUTE:
            store.compute_depth += 1
            self._waited0 = store.nested_wait_s
            self._nested0 = len(store.nested_wait_events)
        pool = store.event_pool
        if pool is not None:
            event = pool.acquire()
            event.record()
            self._start_event = event
        self._t0 = store.timer()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        t0 = self._t0
        if t0 is None:
            return False
        store = self._store
        elapsed = store.timer() - t0
        self._t0 = None
        start, self._start_event = self._start_event, None
        compute = self.kind is COMPUTE
        if compute:
            store.compute_depth -= 1
        if exc_type is not None:  # a failed entry says nothing about speed
            if start is not None:
                store.event_pool.release([start])
            return False
        end = None
        if start is not None:
            end = store.event_pool.acquire()
            end.record()
        store.step_timed = True
        if compute:
            self.cpu_s.append(elapsed - (store.nested_wait_s - self._waited0))
            if end is not None:
                self.cuda.append((start, end, tuple(store.nested_wait_events[self._nested0 :])))
            if store.compute_depth == 0:
                self.top_level += 1
                if store.nested_wait_events:
                    store.nested_wait_events.clear()
        else:
            self.cpu_s.append(elapsed)
            if end is not None:
                self.cuda.append((start, end, ()))
            if store.compute_depth > 0:
                store.nested_wait_s += elapsed
                if end is not None:
                    store.nested_wait_events.append((start, end))
        return False


def wrap_callable(section: Section, fn: Callable) -> Callable:
    """`fn` with every call timed in `section`."""

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        with section:
            return fn(*args, **kwargs)

    return timed


class TimingStore:
    """Every timing sample of one detector since the last report."""

    def __init__(self, timer: Callable[[], float], event_pool: Optional[EventPool] = None):
        self.timer = timer
        self.event_pool = event_pool
        self.active = True
        self.sections: Dict[str, Section] = {}
        self.compute_depth = 0
        self.nested_wait_s = 0.0
        """Total wait time nested in compute sections (only differences are used)."""
        self.nested_wait_events: List[Tuple[Any, Any]] = []
        self.step_timed = False
        self.steps = 0

    def section(self, name: str, kind: str = COMPUTE) -> Section:
        section = self.sections.get(name)
        if section is None:
            if not isinstance(name, str) or not name or name == OVERALL:
                raise ValueError(f"section name {name!r}: must be a non-empty string other than {OVERALL!r}")
            if kind not in SECTION_KINDS:
                raise ValueError(f"section {name!r}: kind {kind!r} must be one of {', '.join(SECTION_KINDS)}")
            section = self.sections[name] = Section(name, COMPUTE if kind == COMPUTE else WAIT, self)
        elif kind != section.kind:
            raise ValueError(f"section {name!r} is a {section.kind!r} section, not {kind!r}")
        return section

    def end_step(self) -> None:
        """Count a step if anything was timed in it (Detector.step, and before a report)."""
        if self.step_timed:
            self.steps += 1
            self.step_timed = False

    def summarize(self) -> IntervalTimes:
        """Medians of this interval; the only place CUDA events are read back."""
        self.end_step()
        sections = {}
        for name, section in self.sections.items():
            if not section.cpu_s:
                continue
            cuda_median = None
            if section.cuda:
                section.cuda[-1][1].synchronize()
                cuda_median = statistics.median(
                    start.elapsed_time(end) - sum(s.elapsed_time(e) for s, e in nested)
                    for start, end, nested in section.cuda
                )
            sections[name] = SectionTimes(
                kind=section.kind,
                count=len(section.cpu_s),
                cpu_ms=statistics.median(section.cpu_s) * 1e3,
                cuda_ms=cuda_median,
                top_level=section.top_level,
            )
        steps = max(self.steps, 1)
        compute = [s.ms * s.top_level / steps for s in sections.values() if s.kind == COMPUTE and s.top_level]
        wait = [s.ms * s.count / steps for s in sections.values() if s.kind == WAIT]
        return IntervalTimes(self.steps, sum(compute) if compute else None, sum(wait) if wait else None, sections)

    def reset(self) -> None:
        """Drop this interval's samples (sections stay registered; callers may hold them)."""
        for section in self.sections.values():
            section.cpu_s.clear()
            section.top_level = 0
            if section.cuda:
                self.event_pool.release(e for start, end, _ in section.cuda for e in (start, end))
                section.cuda.clear()
        self.nested_wait_events.clear()
        self.steps = 0
        self.step_timed = False
