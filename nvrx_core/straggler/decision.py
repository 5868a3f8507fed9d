"""Scoring every rank's payload into a Report: relative scores, hysteresis, flags.

Run on rank 0 (gather_on_rank0) or on every rank (then on identical inputs, so every rank
reaches the same decision without further communication).
"""

from typing import Any, Callable, Dict, List

from nvrx_core.straggler.config import StragglerConfig
from nvrx_core.straggler.report import (
    INDIVIDUAL,
    RELATIVE,
    RankStats,
    Report,
    Straggler,
    find_waited_for,
    sorted_stragglers,
)
from nvrx_core.straggler.scores import Hysteresis, relative_scores
from nvrx_core.straggler.timers import OVERALL


def decide(
    payloads: List[Dict[str, Any]],
    config: StragglerConfig,
    hysteresis: Hysteresis,
    *,
    index: int,
    rank: int,
    interval_s: float,
    started: float,
    clock: Callable[[], float],
) -> Report:
    ranks = {
        p["rank"]: RankStats(p["rank"], p["node"], p["steps"], p["compute_ms"], p["wait_ms"], p["sections"])
        for p in payloads
        if "node" in p  # ranks that timed nothing send their rank only
    }
    relative: Dict[str, Dict[int, float]] = {}
    if config.calc_relative_perf:
        scopes = {OVERALL} | {name for stats in ranks.values() for name in stats.section_ms}
        for scope in sorted(scopes):
            times = {r: (s.compute_ms if scope == OVERALL else s.section_ms.get(scope)) for r, s in ranks.items()}
            relative[scope] = relative_scores(times)
    individual: Dict[str, Dict[int, float]] = {}
    for p in payloads:
        for scope, score in p.get("individual", {}).items():
            individual.setdefault(scope, {})[p["rank"]] = score

    # A slowdown every rank shares (a busy host, longer sequences, a slow filesystem) makes
    # no rank a straggler: individual scores are judged against the least slowed rank's.
    job_individual = {
        scope: min(1.0, max(by_rank.values())) for scope, by_rank in individual.items() if len(by_rank) > 1
    }

    def threshold(kind: str, scope: str) -> float:
        if kind == RELATIVE:
            return config.relative_perf_threshold
        return config.individual_perf_threshold * job_individual.get(scope, 1.0)

    scores = {
        (r, kind, scope): score
        for kind, table in ((RELATIVE, relative), (INDIVIDUAL, individual))
        for scope, by_rank in table.items()
        for r, score in by_rank.items()
    }
    hysteresis.required = config.consecutive_reports
    streaks = hysteresis.update(key for key, score in scores.items() if score < threshold(key[1], key[2]))

    def straggler(key) -> Straggler:
        r, kind, scope = key
        return Straggler(r, ranks[r].node, kind, scope, scores[key], threshold(kind, scope), streaks[key])

    flagged_keys = hysteresis.flagged()
    flagged = [straggler(k) for k in flagged_keys]
    suspects = [straggler(k) for k in streaks if k not in flagged_keys]
    flagged_ranks = tuple(sorted({s.rank for s in flagged}))
    return Report(
        index=index,
        rank=rank,
        world_size=len(payloads),
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
        generation_s=clock() - started,
        job_individual=job_individual,
    )
