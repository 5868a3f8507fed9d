"""What one straggler report holds, and its compact table for logs."""

import dataclasses
from typing import Dict, List, Optional, Tuple

from nvrx_core.straggler.timers import OVERALL

RELATIVE = "relative"
INDIVIDUAL = "individual"


@dataclasses.dataclass(frozen=True)
class RankStats:
    """One rank's medians over the report interval."""

    rank: int
    node: str
    steps: int
    compute_ms: Optional[float]
    """Median per-step compute time."""
    wait_ms: Optional[float]
    """Median per-step time spent in wait sections (collectives): low on the straggler."""
    section_ms: Dict[str, float]
    """Median time of one entry of each compute section (less the waits nested in it)."""


@dataclasses.dataclass(frozen=True)
class Straggler:
    rank: int
    node: str
    score_kind: str
    """"relative" or "individual"."""
    scope: str
    """"overall" (per-step compute) or a section name."""
    score: float
    threshold: float
    """The threshold the score fell below; for individual scores, the configured one times
    the job's least slowed individual score (see Report.job_individual)."""
    consecutive: int
    """Consecutive reports in which this score was below its threshold."""


@dataclasses.dataclass(frozen=True)
class Report:
    """One report. `complete` reports hold every rank; with gather_on_rank0 the others
    hold their own stats, the flagged ranks and the stop decision only."""

    index: int
    rank: int
    world_size: int
    complete: bool
    ranks: Dict[int, RankStats]
    relative: Dict[str, Dict[int, float]]
    """scope ("overall" or section) -> rank -> relative score."""
    individual: Dict[str, Dict[int, float]]
    """scope -> rank -> individual score (ranks still without a baseline are absent)."""
    stragglers: Tuple[Straggler, ...]
    """Flagged: bad for `consecutive_reports` reports in a row (complete reports only)."""
    suspects: Tuple[Straggler, ...]
    """Bad in this report but not (yet) for long enough to be flagged."""
    flagged_ranks: Tuple[int, ...]
    """Ranks with at least one flagged score (known on every rank)."""
    waited_for: Optional[int]
    """The rank that waited least in collectives while the others waited, if clear."""
    stop: bool
    """stop_if_detected is on and a rank is flagged: every rank is about to stop."""
    interval_s: float
    generation_s: float
    job_individual: Dict[str, float] = dataclasses.field(default_factory=dict)
    """scope -> best individual score of any rank, capped at 1. Low: the whole job slowed
    down (not a straggler); individual thresholds are scaled by it."""

    @property
    def rank_to_node(self) -> Dict[int, str]:
        return {rank: stats.node for rank, stats in self.ranks.items()}

    def score(self, score_kind: str, rank: int, scope: str = OVERALL) -> Optional[float]:
        table = self.relative if score_kind == RELATIVE else self.individual
        return table.get(scope, {}).get(rank)

    def _rank_key(self, rank: int) -> float:
        """The rank's lowest score of any kind and scope: what decides if it is flagged."""
        tables = (self.relative, self.individual)
        scores = [by_rank[rank] for table in tables for by_rank in table.values() if rank in by_rank]
        return min(scores) if scores else float("inf")

    def _worst_section(self, rank: int) -> str:
        worst_name, worst = "", float("inf")
        for table in (self.relative, self.individual):
            for scope, by_rank in table.items():
                score = by_rank.get(rank)
                if scope != OVERALL and score is not None and score < worst:
                    worst_name, worst = scope, score
        return f"{worst_name} {worst:.2f}" if worst_name else "-"

    def table(self, rows: int) -> str:
        """Header with flagged ranks, then the `rows` worst and `rows` best ranks (by their
        lowest score); scores in the relative/individual columns are the per-step overall."""
        flagged = "; ".join(
            f"rank {s.rank} ({s.node}) {s.score_kind} {s.scope} {s.score:.2f} x{s.consecutive}" for s in self.stragglers
        )
        job = self.job_individual.get(OVERALL, 1.0)
        lines = [
            f"straggler report #{self.index}: {self.world_size} ranks, {self.interval_s:.2f} s"
            + (f"; FLAGGED: {flagged}" if flagged else "; no straggler")
            + (f"; others waited for rank {self.waited_for}" if self.waited_for is not None else "")
            + (f"; whole job at {job:.2f} of its baseline" if job < 0.9 else "")
        ]
        ordered = sorted(self.ranks, key=lambda r: (self._rank_key(r), r))
        if rows <= 0 or not ordered:
            return "\n".join(lines)
        if len(ordered) <= 2 * rows:
            blocks = [("ranks, worst first", ordered)]
        else:
            blocks = [(f"worst {rows}", ordered[:rows]), (f"best {rows}", ordered[::-1][:rows])]
        width = max(4, *(len(self.ranks[r].node) for r in ordered))
        header = (
            f"  {'rank':>5} {'node':<{width}} {'relative':>8} {'individual':>10} "
            f"{'compute_ms':>10} {'wait_ms':>8}  worst section"
        )
        for title, ranks in blocks:
            lines.append(f" {title}:")
            lines.append(header)
            lines.extend(self._row(r, width) for r in ranks)
        return "\n".join(lines)

    def _row(self, rank: int, width: int) -> str:
        stats = self.ranks[rank]

        def fmt(value: Optional[float], spec: str) -> str:
            return "-" if value is None else format(value, spec)

        return (
            f"  {rank:>5} {stats.node:<{width}} {fmt(self.score(RELATIVE, rank), '.2f'):>8} "
            f"{fmt(self.score(INDIVIDUAL, rank), '.2f'):>10} {fmt(stats.compute_ms, '.2f'):>10} "
            f"{fmt(stats.wait_ms, '.2f'):>8}  {self._worst_section(rank)}"
        )


def find_waited_for(ranks: Dict[int, RankStats]) -> Optional[int]:
    """The rank everyone waits for: the least waiting one, when the others clearly wait.

    "Clearly": the median wait exceeds the smallest by more than 10% of the median compute
    time, so the ordinary noise of a balanced job does not name anybody.
    """
    waits = {r: s.wait_ms for r, s in ranks.items() if s.wait_ms is not None}
    computes = sorted(s.compute_ms for s in ranks.values() if s.compute_ms)
    if len(waits) < 2 or not computes:
        return None
    least = min(waits, key=lambda r: (waits[r], r))
    ordered = sorted(waits.values())
    median_wait = ordered[len(ordered) // 2]
    if median_wait - waits[least] > 0.1 * computes[len(computes) // 2]:
        return least
    return None


def sorted_stragglers(items: List[Straggler]) -> Tuple[Straggler, ...]:
    return tuple(sorted(items, key=lambda s: (s.rank, s.score_kind, s.scope)))
