"""Section timing between two reports: cheap on the hot path, summarized at report time.

Entering and leaving a section costs two clock reads and a list append. On CUDA a section
also records two events on the current stream; they are read back (one synchronize per
section) only when a report is made, so the training loop never waits for the GPU.

Compute is kept apart from waiting: sections of kind "wait" (a collective, a barrier)
are summed separately, and a wait nested inside a compute section is subtracted from it.
The rank the others wait for is the one whose compute is slow and whose wait is short.
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
    """Median wall time of one entry."""
    cuda_ms: Optional[float]
    """Median CUDA-event time of one entry; None when not timed on CUDA."""

    @property
    def ms(self) -> float:
        """The time scores use: CUDA time where measured (it excludes host launch jitter)."""
        return self.cuda_ms if self.cuda_ms is not None else self.cpu_ms


@dataclasses.dataclass(frozen=True)
class IntervalTimes:
    steps: int
    """Steps in which a compute section was timed."""
    compute_ms: Optional[float]
    """Median per-step compute time (top-level compute sections minus nested waits)."""
    wait_ms: Optional[float]
    """Median per-step time inside wait sections."""
    sections: Dict[str, SectionTimes]


class Section:
    """A named timed region; reusable, not re-entrant, used from the training thread."""

    __slots__ = ("name", "kind", "_store", "_t0", "_start_event", "cpu_s", "cuda_pairs")

    def __init__(self, name: str, kind: str, store: "TimingStore"):
        self.name = name
        self.kind = kind
        self._store = store
        self._t0: Optional[float] = None
        self._start_event = None
        self.cpu_s: List[float] = []
        self.cuda_pairs: List[Tuple[Any, Any]] = []

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
        self.cpu_s.append(elapsed)
        pair = None
        if start is not None:
            end = store.event_pool.acquire()
            end.record()
            pair = (start, end)
            self.cuda_pairs.append(pair)
        if compute:
            if store.compute_depth == 0:
                store.step_compute += elapsed
                store.step_has_compute = True
                if pair is not None:
                    store.step_cuda.append((pair, 1))
        else:
            store.step_wait += elapsed
            store.step_has_wait = True
            if store.compute_depth > 0:
                store.step_compute -= elapsed
                if pair is not None:
                    store.step_cuda.append((pair, -1))
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
        self.step_compute = 0.0
        self.step_wait = 0.0
        self.step_has_compute = False
        self.step_has_wait = False
        self.step_cuda: List[Tuple[Tuple[Any, Any], int]] = []
        self._compute_totals: List[float] = []
        self._wait_totals: List[float] = []
        self._cuda_steps: List[List[Tuple[Tuple[Any, Any], int]]] = []

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
        """Close the current step's totals (called by Detector.step and before a report)."""
        if self.step_has_compute:
            self._compute_totals.append(self.step_compute)
            if self.step_cuda:
                self._cuda_steps.append(self.step_cuda)
        if self.step_has_wait:
            self._wait_totals.append(self.step_wait)
        self.step_compute = self.step_wait = 0.0
        self.step_has_compute = self.step_has_wait = False
        self.step_cuda = []

    def summarize(self) -> IntervalTimes:
        """Medians of this interval; the only place CUDA events are read back."""
        self.end_step()
        cuda_ms: Dict[int, float] = {}
        sections = {}
        for name, section in self.sections.items():
            if not section.cpu_s:
                continue
            cuda_median = None
            if section.cuda_pairs:
                section.cuda_pairs[-1][1].synchronize()
                times = [start.elapsed_time(end) for start, end in section.cuda_pairs]
                cuda_ms.update((id(pair), t) for pair, t in zip(section.cuda_pairs, times))
                cuda_median = statistics.median(times)
            sections[name] = SectionTimes(
                kind=section.kind,
                count=len(section.cpu_s),
                cpu_ms=statistics.median(section.cpu_s) * 1e3,
                cuda_ms=cuda_median,
            )
        compute_ms = None
        if self._cuda_steps and len(self._cuda_steps) == len(self._compute_totals):
            compute_ms = statistics.median(
                sum(sign * cuda_ms[id(pair)] for pair, sign in step) for step in self._cuda_steps
            )
        elif self._compute_totals:
            compute_ms = statistics.median(self._compute_totals) * 1e3
        wait_ms = statistics.median(self._wait_totals) * 1e3 if self._wait_totals else None
        return IntervalTimes(len(self._compute_totals), compute_ms, wait_ms, sections)

    def reset(self) -> None:
        """Drop this interval's samples (sections stay registered; callers may hold them)."""
        for section in self.sections.values():
            section.cpu_s.clear()
            if section.cuda_pairs:
                self.event_pool.release(e for pair in section.cuda_pairs for e in pair)
                section.cuda_pairs.clear()
        self._compute_totals.clear()
        self._wait_totals.clear()
        self._cuda_steps.clear()
        self.step_compute = self.step_wait = 0.0
        self.step_has_compute = self.step_has_wait = False
        self.step_cuda = []
