"""Detector: times sections on every rank, agrees on when to report, scores, acts.

Typical loop (every rank runs the same number of step() calls):

    detector = Detector(StragglerConfig(report_time_interval=60), checkpoint_hook=save)
    for batch in data:
        with detector.section("forward"):
            loss = model(batch)
        with detector.section("backward"):
            loss.backward()
        with detector.section("grad_sync", kind="wait"):
            all_reduce_grads()
        report = detector.step()          # None between reports

Between reports step() only counts steps: ranks agree on "is a report due" with one
three-float all_reduce a few times per report interval (schedule_checks_per_interval),
the step count to the next check sized from the measured step time. A report is two
small collectives (gather of JSON payloads, broadcast of rank 0's decision).
"""

import dataclasses
import functools
import json
import logging
import socket
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from nvrx_core.events import STRAGGLER_FOUND, EventLog
from nvrx_core.exit_codes import ExitCode
from nvrx_core.straggler.collective import make_collectives
from nvrx_core.straggler.config import StragglerConfig
from nvrx_core.straggler.control import CONTROL_FIELDS, ControlFile
from nvrx_core.straggler.report import (
    INDIVIDUAL,
    RELATIVE,
    RankStats,
    Report,
    Straggler,
    find_waited_for,
    sorted_stragglers,
)
from nvrx_core.straggler.scores import Hysteresis, RollingBaseline, relative_scores
from nvrx_core.straggler.timers import COMPUTE, OVERALL, EventPool, IntervalTimes, Section, TimingStore, wrap_callable

STRAGGLER_CLEARED = "straggler_cleared"
"""Event kind: a flagged score is back above its threshold."""

MAX_STEPS_BETWEEN_CHECKS = 100_000

ScoreKey = Tuple[int, str, str]  # (rank, score kind, scope)


class Detector:
    """Straggler detector for one rank. Not a singleton: make one per training run.

    group: process group to score over (default: the default group, or a world of one).
    events: event log (default: EventLog.from_env("straggler")).
    checkpoint_hook: called with the report on every rank before a straggler stop.
    clock / timer: report schedule clock and section timer (injectable for tests).
    exit_fn: how a straggler stop ends the process (default sys.exit, i.e. SystemExit).
    cuda_event_factory: makes timing events when CUDA timing is on (default torch.cuda.Event).
    """

    def __init__(
        self,
        config: Optional[StragglerConfig] = None,
        *,
        group: Any = None,
        events: Optional[EventLog] = None,
        checkpoint_hook: Optional[Callable[[Report], None]] = None,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
        exit_fn: Callable[[int], Any] = sys.exit,
        cuda_event_factory: Optional[Callable[[], Any]] = None,
    ):
        self._base = config if config is not None else StragglerConfig()
        self._config = self._base
        self._logger = logging.getLogger(self._base.logger_name)
        self._coll = make_collectives(group)
        self.rank = self._coll.rank
        self.world_size = self._coll.world_size
        self.node = self._base.node_name or socket.gethostname()
        self._events = events if events is not None else EventLog.from_env("straggler")
        self._checkpoint_hook = checkpoint_hook
        self._exit = exit_fn
        self._clock = clock
        self._control = (
            ControlFile(self._base.control_file, self._logger) if self._base.control_file and self.rank == 0 else None
        )
        self._store = TimingStore(timer, self._event_pool(cuda_event_factory))
        self._store.active = self._base.enabled
        self._baseline = RollingBaseline(self._base.baseline_window, self._base.warmup_reports)
        self._hysteresis = Hysteresis(self._base.consecutive_reports)
        self._flagged_keys: Dict[ScoreKey, Straggler] = {}
        self._patched: List[Tuple[Any, str, Any]] = []
        self._step_index = 0
        self._report_index = 0
        self._last_report = self._last_check = clock()
        self._check_every = self._steps_to_check = 1
        self._bound_sections, self._bound = -1, 0
        if self._base.stop_if_detected and checkpoint_hook is None:
            self._logger.warning(
                "straggler stop_if_detected is on without a checkpoint_hook: a stop loses the progress "
                "made since the last checkpoint"
            )

    def _event_pool(self, factory: Optional[Callable[[], Any]]) -> Optional[EventPool]:
        mode = self._base.cuda_timing
        if mode == "off" or (mode == "auto" and self._coll.device.type != "cuda"):
            return None
        if factory is None:
            import torch  # only reached when CUDA timing is asked for

            if not torch.cuda.is_available():
                raise RuntimeError("straggler cuda_timing='on' but CUDA is not available; use 'auto' or 'off'")
            factory = functools.partial(torch.cuda.Event, enable_timing=True)
        return EventPool(factory)

    @property
    def config(self) -> StragglerConfig:
        """Settings in effect (the configured ones plus rank 0's control-file changes)."""
        return self._config

    @property
    def report_count(self) -> int:
        """Reports made so far, including those skipped while detection was disabled."""
        return self._report_index

    # ---- timing ----

    def section(self, name: str, kind: str = COMPUTE) -> Section:
        """Context manager timing a region. kind "wait" marks time spent waiting for other
        ranks (collectives, barriers): it is reported apart and not scored."""
        return self._store.section(name, kind)

    def wrap(self, fn: Optional[Callable] = None, *, name: Optional[str] = None, kind: str = COMPUTE):
        """`fn` timed in a section (named after it by default); usable as a decorator."""
        if fn is None:
            return lambda f: self.wrap(f, name=name, kind=kind)
        return wrap_callable(self.section(name or fn.__qualname__, kind), fn)

    def wrap_attribute(self, owner: Any, attribute: str, *, name: Optional[str] = None, kind: str = COMPUTE) -> None:
        """Replace owner.attribute (a method, a module's forward, a function) by a timed
        version until close(); the section is named "<owner>.<attribute>" by default."""
        original = getattr(owner, attribute)
        label = name or f"{getattr(owner, '__name__', type(owner).__name__)}.{attribute}"
        previous = vars(owner).get(attribute, _ABSENT) if hasattr(owner, "__dict__") else _ABSENT
        self._patched.append((owner, attribute, previous))
        setattr(owner, attribute, wrap_callable(self.section(label, kind), original))

    def step(self) -> Optional[Report]:
        """End one training step; returns a Report when one was due (on every rank)."""
        store = self._store
        if store.step_has_compute or store.step_has_wait:
            store.end_step()
        self._step_index += 1
        if self._config.profiling_interval > 1:
            store.active = self._config.enabled and self._step_index % self._config.profiling_interval == 0
        self._steps_to_check -= 1
        if self._steps_to_check > 0:
            return None
        return self._check_schedule()

    def _check_schedule(self) -> Optional[Report]:
        """One all_reduce of three floats: is a report due on any rank, and how many steps
        until the next check, for either outcome. Checks aim at the due time, but are at
        most 1/schedule_checks_per_interval of the interval apart, so a change of step time
        delays a report by a fraction of the interval at most."""
        now = self._clock()
        step_s = max((now - self._last_check) / self._check_every, 1e-9)
        self._last_check = now
        interval = self._config.report_time_interval
        gap = interval / self._config.schedule_checks_per_interval
        left = interval - (now - self._last_report)

        def steps_for(seconds: float) -> float:
            return -float(min(max(round(seconds / step_s), 1), MAX_STEPS_BETWEEN_CHECKS))  # negated: max = min

        due = left <= step_s / 2  # the next step would overshoot more than this one falls short
        agreed = self._coll.max_floats(
            [1.0 if due else 0.0, steps_for(min(interval, gap)), steps_for(min(left, gap)), self._payload_bound()]
        )
        report_now = agreed[0] > 0
        self._check_every = self._steps_to_check = int(-(agreed[1] if report_now else agreed[2]))
        return self._report(payload_size=int(agreed[3])) if report_now else None

    def _payload_bound(self) -> int:
        """Upper bound of this rank's report payload in bytes, agreed on in the schedule check
        so that the report needs no collective of its own to size the gather. Sections are
        never removed, so the bound only changes when one is added."""
        if self._bound_sections != len(self._store.sections):
            names = [name for name, s in self._store.sections.items() if s.kind == COMPUTE]
            skeleton = dict.fromkeys(("rank", "steps", "compute_ms", "wait_ms"), _NUMBER)
            skeleton.update(
                node=self.node,
                sections=dict.fromkeys(names, _NUMBER),
                individual=dict.fromkeys(names + [OVERALL], _NUMBER),
            )
            if self.rank == 0:
                skeleton["settings"] = dict.fromkeys(CONTROL_FIELDS, _NUMBER)
            self._bound = len(json.dumps(skeleton, separators=(",", ":")).encode())
            self._bound_sections = len(self._store.sections)
        return self._bound

    # ---- reporting ----

    def generate_report(self) -> Optional[Report]:
        """Collective: gather, score and act. None while detection is disabled or when no
        rank timed anything in the interval. step() calls it when a report is due; call it
        directly only on every rank at the same point."""
        return self._report(payload_size=None)

    def _report(self, payload_size: Optional[int]) -> Optional[Report]:
        started = self._clock()
        interval_s = started - self._last_report
        self._last_report = started
        self._report_index += 1
        if self._control is not None:
            self._config = self._control.apply(self._base)
        times = self._store.summarize()
        self._store.reset()
        mine = self._local_payload(times) if self._config.enabled else {"rank": self.rank}
        if self.rank == 0:
            mine["settings"] = {k: getattr(self._config, k) for k in CONTROL_FIELDS}
        to_all = not self._config.gather_on_rank0
        payloads = self._coll.gather_json(mine, to_all, payload_size)
        report = None
        if payloads is not None:
            self._apply_settings(payloads[0]["settings"])
            timed = any(p.get("steps") for p in payloads)  # nothing right after enabling
            if self._config.enabled and timed:  # rank 0's setting: the same on every rank
                report = self._decide(payloads, interval_s, started)
        if not to_all:  # rank 0 scored alone: tell the others what they need
            report = self._share_decision(report, mine, interval_s, started)
        self._update_baseline(mine)
        self._store.active = self._config.enabled and self._step_index % self._config.profiling_interval == 0
        if report is not None:
            self._act(report)
        return report

    def _local_payload(self, times: IntervalTimes) -> Dict[str, Any]:
        sections = {n: s.ms for n, s in times.sections.items() if s.kind == COMPUTE}
        payload = {
            "rank": self.rank,
            "node": self.node,
            "steps": times.steps,
            "compute_ms": times.compute_ms,
            "wait_ms": times.wait_ms,
            "sections": sections,
        }
        if self._config.calc_individual_perf:
            current = {**sections, OVERALL: times.compute_ms}
            payload["individual"] = {
                scope: score
                for scope, ms in current.items()
                if (score := self._baseline.score(scope, ms)) is not None
            }
        return payload

    def _apply_settings(self, settings: Dict[str, Any]) -> None:
        """Adopt rank 0's runtime settings so every rank switches at the same step."""
        if self.rank != 0:
            self._config = dataclasses.replace(self._config, **settings)
        self._hysteresis.required = self._config.consecutive_reports

    def _decide(self, payloads: List[Dict[str, Any]], interval_s: float, started: float) -> Report:
        """Scores and flags from every rank's payload (same result on every deciding rank)."""
        config = self._config
        ranks = {
            p["rank"]: RankStats(p["rank"], p["node"], p["steps"], p["compute_ms"], p["wait_ms"], p["sections"])
            for p in payloads
            if "node" in p
        }
        relative: Dict[str, Dict[int, float]] = {}
        if config.calc_relative_perf:
            scopes = {OVERALL} | {name for s in ranks.values() for name in s.section_ms}
            for scope in sorted(scopes):
                times = {r: (s.compute_ms if scope == OVERALL else s.section_ms.get(scope)) for r, s in ranks.items()}
                relative[scope] = relative_scores(times)
        individual: Dict[str, Dict[int, float]] = {}
        for p in payloads:
            for scope, score in p.get("individual", {}).items():
                individual.setdefault(scope, {})[p["rank"]] = score
        thresholds = {RELATIVE: config.relative_perf_threshold, INDIVIDUAL: config.individual_perf_threshold}
        scores: Dict[ScoreKey, float] = {}
        for kind, table in ((RELATIVE, relative), (INDIVIDUAL, individual)):
            for scope, by_rank in table.items():
                scores.update(((r, kind, scope), s) for r, s in by_rank.items())
        streaks = self._hysteresis.update(k for k, s in scores.items() if s < thresholds[k[1]])

        def straggler(key: ScoreKey) -> Straggler:
            rank, kind, scope = key
            return Straggler(rank, ranks[rank].node, kind, scope, scores[key], thresholds[kind], streaks[key])

        flagged = [straggler(k) for k, n in streaks.items() if n >= config.consecutive_reports]
        suspects = [straggler(k) for k, n in streaks.items() if n < config.consecutive_reports]
        flagged_ranks = tuple(sorted({s.rank for s in flagged}))
        return Report(
            index=self._report_index,
            rank=self.rank,
            world_size=self.world_size,
            complete=True,
            ranks=ranks,
            relative=relative,
            individual=individual,
            stragglers=sorted_stragglers(flagged),
            suspects=sorted_stragglers(suspects),
            flagged_ranks=flagged_ranks,
            waited_for=find_waited_for(ranks),
            stop=config.stop_if_detected and bool(flagged_ranks),
            interval_s=interval_s,
            generation_s=self._clock() - started,
        )

    def _share_decision(
        self, report: Optional[Report], mine: Dict[str, Any], interval_s: float, started: float
    ) -> Optional[Report]:
        """gather_on_rank0: broadcast rank 0's settings, stop flag and flagged ranks."""
        length = len(CONTROL_FIELDS) + 2 + self.world_size
        values = None
        if self.rank == 0:
            flags = [0.0] * self.world_size
            for r in report.flagged_ranks if report is not None else ():
                flags[r] = 1.0
            values = [float(getattr(self._config, k)) for k in CONTROL_FIELDS]
            values += [1.0 if report is not None else 0.0, 1.0 if report is not None and report.stop else 0.0]
            values += flags
        shared = self._coll.broadcast_floats(values, length)
        if self.rank == 0:
            return report
        settings = {k: _FIELD_TYPES[k](v) for k, v in zip(CONTROL_FIELDS, shared)}
        self._apply_settings(settings)
        has_report, stop = shared[len(CONTROL_FIELDS)] > 0, shared[len(CONTROL_FIELDS) + 1] > 0
        if not has_report:
            return None
        ranks = {}
        if "sections" in mine:  # this rank timed the interval
            ranks[self.rank] = RankStats(
                self.rank, self.node, mine["steps"], mine["compute_ms"], mine["wait_ms"], mine["sections"]
            )
        own_individual = {scope: {self.rank: s} for scope, s in mine.get("individual", {}).items()}
        return Report(
            index=self._report_index,
            rank=self.rank,
            world_size=self.world_size,
            complete=False,
            ranks=ranks,
            relative={},
            individual=own_individual,
            stragglers=(),
            suspects=(),
            flagged_ranks=tuple(r for r, f in enumerate(shared[len(CONTROL_FIELDS) + 2 :]) if f > 0),
            waited_for=None,
            stop=stop,
            interval_s=interval_s,
            generation_s=self._clock() - started,
        )

    def _update_baseline(self, mine: Dict[str, Any]) -> None:
        if not self._config.calc_individual_perf or "sections" not in mine:
            return
        threshold = self._config.individual_perf_threshold
        scores = mine.get("individual", {})
        for scope, ms in {**mine["sections"], OVERALL: mine["compute_ms"]}.items():
            score = scores.get(scope)
            self._baseline.update(scope, ms, accepted=score is None or score >= threshold)

    def reset_baseline(self) -> None:
        """Forget the individual baselines (after an intended change of the workload)."""
        self._baseline.reset()

    # ---- actions ----

    def _act(self, report: Report) -> None:
        if report.complete and self.rank == 0:
            self._log(report)
            self._emit_changes(report)
        if report.stop:
            self._stop(report)

    def _log(self, report: Report) -> None:
        if not self._config.enable_logging:
            return
        if report.stragglers:
            self._logger.warning("%s", report.table(max(self._config.num_scores_to_print, 1)))
        elif self._config.num_scores_to_print > 0:
            self._logger.info("%s", report.table(self._config.num_scores_to_print))

    def _emit_changes(self, report: Report) -> None:
        """One event when a score becomes flagged, one when it recovers."""
        now = {(s.rank, s.score_kind, s.scope): s for s in report.stragglers}
        for key, s in now.items():
            if key not in self._flagged_keys:
                self._events.emit(
                    STRAGGLER_FOUND,
                    straggler_rank=s.rank,
                    straggler_node=s.node,
                    score_kind=s.score_kind,
                    scope=s.scope,
                    score=round(s.score, 4),
                    threshold=s.threshold,
                    consecutive=s.consecutive,
                    report_index=report.index,
                    action="stop" if report.stop else "report",
                )
        for key, s in self._flagged_keys.items():
            if key not in now:
                self._events.emit(
                    STRAGGLER_CLEARED,
                    straggler_rank=s.rank,
                    straggler_node=s.node,
                    score_kind=s.score_kind,
                    scope=s.scope,
                    report_index=report.index,
                )
        self._flagged_keys = now

    def _stop(self, report: Report) -> None:
        code = int(ExitCode.STRAGGLER_STOP)
        self._logger.error(
            "straggler stop: rank(s) %s flagged and stop_if_detected is on; checkpointing, then exiting with %d",
            list(report.flagged_ranks),
            code,
        )
        if self._checkpoint_hook is not None:
            self._checkpoint_hook(report)  # if it raises, the error propagates: no code 19 without a checkpoint
        self.close()
        self._exit(code)

    def close(self) -> None:
        """Undo wrap_attribute patches. Idempotent."""
        while self._patched:
            owner, attribute, previous = self._patched.pop()
            if previous is _ABSENT:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, previous)

    def __enter__(self) -> "Detector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_ABSENT = object()
_NUMBER = "x" * 30  # wider in JSON than any number a payload holds (a float's repr has <= 24 chars)


def _from_float(kind: type) -> Callable[[float], Any]:
    """Turns a broadcast float back into a value of a config field's type."""
    if kind is bool:
        return lambda v: v > 0
    if kind is int:
        return lambda v: int(round(v))
    return float


_FIELD_TYPES = {f.name: _from_float(type(f.default)) for f in dataclasses.fields(StragglerConfig) if f.name in CONTROL_FIELDS}
