"""Detector: times sections on every rank, agrees on when to report, scores, acts.

Typical loop (every rank makes the same number of step() calls):

    detector = Detector(StragglerConfig(report_time_interval=60), checkpoint_hook=save)
    for batch in data:
        with detector.section("forward"):
            loss = model(batch)
        with detector.section("backward"):
            loss.backward()
        with detector.section("grad_sync", kind="wait"):
            all_reduce_grads()
        report = detector.step()          # None between reports

Between reports a section costs two clock reads and step() a countdown. A few times per
report interval one all_reduce of four floats decides whether a report is due (see
schedule.py) and bounds the payload size; a report is then one gather of small JSON
payloads plus, with gather_on_rank0, one broadcast of rank 0's decision.
"""

import dataclasses
import functools
import logging
import socket
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from nvrx_core.collectives import Collectives
from nvrx_core.events import EventLog
from nvrx_core.straggler.actions import ReportActions
from nvrx_core.straggler.config import StragglerConfig
from nvrx_core.straggler.control import ControlFile
from nvrx_core.straggler.decision import decide
from nvrx_core.straggler.exchange import (
    decision_length,
    local_payload,
    pack_decision,
    payload_bound,
    settings_of,
    unpack_decision,
)
from nvrx_core.straggler.report import RankStats, Report
from nvrx_core.straggler.schedule import ReportSchedule
from nvrx_core.straggler.scores import Hysteresis, RollingBaseline
from nvrx_core.straggler.timers import COMPUTE, OVERALL, EventPool, Section, TimingStore, wrap_callable

_ABSENT = object()


class Detector:
    """Straggler detector for one rank. Not a singleton: make one per training run.

    group: process group to score over (default: the default group, or a world of one).
    events: event log (default: EventLog.from_env("straggler")).
    checkpoint_hook: called with the report on every rank before a straggler stop.
    clock / timer: report schedule clock and section timer (injectable for tests).
    exit_fn: how a straggler stop ends the process (default sys.exit, i.e. SystemExit).
        None: the detector decides the stop (report.stop, the same on every rank) and the
        training loop acts on it, as in loops that checkpoint and exit themselves
        (Megatron-Bridge's); no checkpoint_hook is needed then.
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
        exit_fn: Optional[Callable[[int], Any]] = sys.exit,
        cuda_event_factory: Optional[Callable[[], Any]] = None,
    ):
        self._base = config if config is not None else StragglerConfig()
        self._config = self._base
        logger = logging.getLogger(self._base.logger_name)
        self._coll = Collectives(group)
        self.rank = self._coll.rank
        self.world_size = self._coll.world_size
        self.node = self._base.node_name or socket.gethostname()
        self._clock = clock
        self._schedule = ReportSchedule(clock)
        control_file = self._base.control_file if self.rank == 0 else None
        self._control = ControlFile(control_file, logger) if control_file else None
        self._store = TimingStore(timer, self._event_pool(cuda_event_factory))
        self._store.active = self._base.enabled
        self._baseline = RollingBaseline(self._base.baseline_window, self._base.warmup_reports)
        self._hysteresis = Hysteresis(self._base.consecutive_reports)
        events = events if events is not None else EventLog.from_env("straggler")
        self._actions = ReportActions(logger, events, checkpoint_hook, exit_fn)
        self._patched: List[Tuple[Any, str, Any]] = []
        self._step_index = 0
        self._report_index = 0
        self._bound_sections, self._bound = -1, 0
        if self._base.stop_if_detected and checkpoint_hook is None and exit_fn is not None:
            logger.warning(
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
        if store.step_timed:
            store.end_step()
        self._step_index += 1
        if self._config.profiling_interval > 1:
            store.active = self._config.enabled and self._step_index % self._config.profiling_interval == 0
        if not self._schedule.count_step():
            return None
        config = self._config
        proposal = self._schedule.proposal(config.report_time_interval, config.schedule_checks_per_interval)
        agreed = self._coll.all_reduce_max([float(v) for v in proposal + [self._payload_bound()]])
        if not self._schedule.agree(agreed):
            return None
        return self._report(payload_size=int(agreed[-1]))

    def _payload_bound(self) -> int:
        if self._bound_sections != len(self._store.sections):  # sections are never removed
            compute = [name for name, s in self._store.sections.items() if s.kind == COMPUTE]
            self._bound = payload_bound(self.rank, self.node, compute)
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
        interval_s = self._schedule.start_report()
        self._report_index += 1
        if self._control is not None:
            self._config = self._control.apply(self._base)
        times = self._store.summarize()
        self._store.reset()
        if self._config.enabled:
            baseline = self._baseline if self._config.calc_individual_perf else None
            mine = local_payload(self.rank, self.node, times, baseline)
        else:
            mine = {"rank": self.rank}
        if self.rank == 0:
            mine["settings"] = settings_of(self._config)
        to_all = not self._config.gather_on_rank0
        payloads = (self._coll.all_gather_json if to_all else self._coll.gather_json)(mine, payload_size)
        report = None
        if payloads is not None:
            self._apply_settings(payloads[0]["settings"])
            timed = any(p.get("steps") for p in payloads)  # nothing right after enabling
            if self._config.enabled and timed:  # rank 0's setting: the same on every rank
                report = decide(
                    payloads,
                    self._config,
                    self._hysteresis,
                    index=self._report_index,
                    rank=self.rank,
                    interval_s=interval_s,
                    started=started,
                    clock=self._clock,
                )
        if not to_all:  # rank 0 scored alone: tell the others what they need
            report = self._share_decision(report, mine, interval_s, started)
        self._update_baseline(mine)
        self._store.active = self._config.enabled and self._step_index % self._config.profiling_interval == 0
        if report is not None:
            if report.complete and self.rank == 0:
                self._actions.log(report, self._config)
                self._actions.emit_scores(report)
                self._actions.emit_changes(report)
            if report.stop:
                self._actions.stop(report, before_exit=self.close)
        return report

    def _apply_settings(self, settings: Dict[str, Any]) -> None:
        """Adopt rank 0's runtime settings so every rank switches at the same step."""
        if self.rank != 0:
            self._config = dataclasses.replace(self._config, **settings)

    def _share_decision(
        self, report: Optional[Report], mine: Dict[str, Any], interval_s: float, started: float
    ) -> Optional[Report]:
        """gather_on_rank0: broadcast rank 0's settings, stop flag and flagged ranks."""
        values = pack_decision(self._config, report, self.world_size) if self.rank == 0 else None
        shared = self._coll.broadcast_floats(values, decision_length(self.world_size))
        if self.rank == 0:
            return report
        settings, has_report, stop, flagged_ranks = unpack_decision(shared)
        self._apply_settings(settings)
        if not has_report:
            return None
        ranks = {}
        if "sections" in mine:  # this rank timed the interval
            ranks[self.rank] = RankStats(
                self.rank, self.node, mine["steps"], mine["compute_ms"], mine["wait_ms"], mine["sections"]
            )
        return Report(
            index=self._report_index,
            rank=self.rank,
            world_size=self.world_size,
            complete=False,
            ranks=ranks,
            relative={},
            individual={scope: {self.rank: s} for scope, s in mine.get("individual", {}).items()},
            stragglers=(),
            suspects=(),
            flagged_ranks=flagged_ranks,
            waited_for=None,
            stop=stop,
            interval_s=interval_s,
            generation_s=self._clock() - started,
        )

    def _update_baseline(self, mine: Dict[str, Any]) -> None:
        """Feed this report's times to the individual baseline; a report whose individual
        score was bad is kept out of it, so a slowed rank stays flagged while slow."""
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
