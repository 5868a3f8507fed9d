"""What a report leads to: a log table, its scores as an event, events when a score becomes flagged or recovers,
and, with stop_if_detected, the documented stop: checkpoint hook, then exit code 19."""

import logging
from typing import Any, Callable, Dict, Optional, Tuple

from nvrx_core.events import STRAGGLER_CLEARED, STRAGGLER_FOUND, STRAGGLER_SCORES, EventLog
from nvrx_core.exit_codes import ExitCode
from nvrx_core.straggler.config import StragglerConfig
from nvrx_core.straggler.report import Report, Straggler
from nvrx_core.straggler.timers import OVERALL

"""Event kind: a flagged score is back above its threshold."""


class ReportActions:
    def __init__(
        self,
        logger: logging.Logger,
        events: EventLog,
        checkpoint_hook: Optional[Callable[[Report], None]],
        exit_fn: Optional[Callable[[int], Any]],
    ):
        self._logger = logger
        self._events = events
        self._checkpoint_hook = checkpoint_hook
        self._exit = exit_fn
        self._flagged: Dict[Tuple[int, str, str], Straggler] = {}

    def log(self, report: Report, config: StragglerConfig) -> None:
        if not config.enable_logging:
            return
        if report.stragglers:
            self._logger.warning("%s", report.table(max(config.num_scores_to_print, 1)))
        elif config.num_scores_to_print > 0:
            self._logger.info("%s", report.table(config.num_scores_to_print))

    def emit_scores(self, report: Report) -> None:
        """Every rank's overall relative score, one event per report: the report's heatmap."""
        scores = report.relative.get(OVERALL, {})
        if scores:
            self._events.emit(STRAGGLER_SCORES, report_index=report.index,
                              scores={str(rank): round(score, 4) for rank, score in sorted(scores.items())})

    def emit_changes(self, report: Report) -> None:
        """One event when a score becomes flagged, one when it recovers (not one per report)."""
        now = {(s.rank, s.score_kind, s.scope): s for s in report.stragglers}
        for key, s in now.items():
            if key not in self._flagged:
                self._events.emit(STRAGGLER_FOUND, **_which_score(s), score=round(s.score, 4),
                                  threshold=s.threshold, consecutive=s.consecutive, report_index=report.index,
                                  action="stop" if report.stop else "report")
        for key, s in self._flagged.items():
            if key not in now:
                self._events.emit(STRAGGLER_CLEARED, **_which_score(s), report_index=report.index)
        self._flagged = now

    def stop(self, report: Report, before_exit: Callable[[], None]) -> None:
        """Checkpoint, then exit with STRAGGLER_STOP. If the hook raises, its error
        propagates: the process must not claim a saved checkpoint it does not have.
        Without an exit_fn the training loop stops on report.stop; nothing is undone here,
        as the loop may still time its checkpoint."""
        code = int(ExitCode.STRAGGLER_STOP)
        if self._exit is None:
            self._logger.error(
                "straggler stop: rank(s) %s flagged and stop_if_detected is on; the training loop checkpoints "
                "and stops", list(report.flagged_ranks))
            if self._checkpoint_hook is not None:
                self._checkpoint_hook(report)
            return
        self._logger.error(
            "straggler stop: rank(s) %s flagged and stop_if_detected is on; checkpointing, then exiting with %d",
            list(report.flagged_ranks),
            code,
        )
        if self._checkpoint_hook is not None:
            self._checkpoint_hook(report)
        before_exit()
        self._exit(code)


def _which_score(straggler) -> dict:
    """The fields that say whose score it is: a found and its cleared event carry the same ones."""
    return dict(straggler_rank=straggler.rank, straggler_node=straggler.node,
                score_kind=straggler.score_kind, scope=straggler.scope)
