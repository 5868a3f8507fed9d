"""What ranks send each other at a report: a JSON payload per rank, and (with
gather_on_rank0) rank 0's decision as a vector of floats."""

import dataclasses
import json
from typing import Any, Dict, Iterable, List, Optional, Tuple

from nvrx_core.straggler.config import StragglerConfig
from nvrx_core.straggler.control import CONTROL_FIELDS
from nvrx_core.straggler.report import Report
from nvrx_core.straggler.scores import RollingBaseline
from nvrx_core.straggler.timers import COMPUTE, OVERALL, IntervalTimes

_NUMBER = "x" * 30  # wider in JSON than any number a payload holds (a float's repr has <= 24 chars)


def local_payload(
    rank: int, node: str, times: IntervalTimes, baseline: Optional[RollingBaseline]
) -> Dict[str, Any]:
    """This rank's medians, and its individual scores when `baseline` is given."""
    sections = {name: s.ms for name, s in times.sections.items() if s.kind == COMPUTE}
    payload = {
        "rank": rank,
        "node": node,
        "steps": times.steps,
        "compute_ms": times.compute_ms,
        "wait_ms": times.wait_ms,
        "sections": sections,
    }
    if baseline is not None:
        current = {**sections, OVERALL: times.compute_ms}
        payload["individual"] = {
            scope: score for scope, ms in current.items() if (score := baseline.score(scope, ms)) is not None
        }
    return payload


def payload_bound(rank: int, node: str, compute_sections: Iterable[str]) -> int:
    """Bytes that local_payload (plus rank 0's settings) can never exceed, given the
    compute sections registered so far. Agreed on before a report, it sizes the gather
    without a collective of its own."""
    names = list(compute_sections)
    skeleton: Dict[str, Any] = dict.fromkeys(("rank", "steps", "compute_ms", "wait_ms"), _NUMBER)
    skeleton.update(
        node=node,
        sections=dict.fromkeys(names, _NUMBER),
        individual=dict.fromkeys(names + [OVERALL], _NUMBER),
    )
    if rank == 0:
        skeleton["settings"] = dict.fromkeys(CONTROL_FIELDS, _NUMBER)
    return len(json.dumps(skeleton, separators=(",", ":")).encode())


def settings_of(config: StragglerConfig) -> Dict[str, Any]:
    """The runtime-controllable settings rank 0 hands to every rank at each report."""
    return {name: getattr(config, name) for name in CONTROL_FIELDS}


def decision_length(world_size: int) -> int:
    return len(CONTROL_FIELDS) + 2 + world_size


def pack_decision(config: StragglerConfig, report: Optional[Report], world_size: int) -> List[float]:
    """[settings..., has report, stop, flagged per rank...]."""
    flags = [0.0] * world_size
    for rank in report.flagged_ranks if report is not None else ():
        flags[rank] = 1.0
    values = [float(value) for value in settings_of(config).values()]
    values += [1.0 if report is not None else 0.0, 1.0 if report is not None and report.stop else 0.0]
    return values + flags


def unpack_decision(values: List[float]) -> Tuple[Dict[str, Any], bool, bool, Tuple[int, ...]]:
    """(settings, has report, stop, flagged ranks) from pack_decision's vector."""
    n = len(CONTROL_FIELDS)
    settings = {name: _FROM_FLOAT[name](v) for name, v in zip(CONTROL_FIELDS, values)}
    flagged = tuple(rank for rank, flag in enumerate(values[n + 2 :]) if flag > 0)
    return settings, values[n] > 0, values[n + 1] > 0, flagged


def _from_float(kind: type):
    if kind is bool:
        return lambda v: v > 0
    if kind is int:
        return lambda v: int(round(v))
    return float


_FROM_FLOAT = {
    f.name: _from_float(type(f.default)) for f in dataclasses.fields(StragglerConfig) if f.name in CONTROL_FIELDS
}
