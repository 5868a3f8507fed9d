"""The plan of a restart iteration, and how the next one follows from what went wrong.

One rank (the first through the restart barrier) computes the next Plan and publishes it
with compare-and-set, so every rank acts on the same plan even if a policy were not
deterministic. The computation itself is pure and unit-tested.

Fault attribution: if ranks were lost in the iteration (killed, hard timeout, heartbeat,
failed health check), they caused it; otherwise the rank whose exception or soft timeout
was recorded first did. Other ranks' errors (a collective failing because a peer died)
are consequences, not faults.
"""

import dataclasses
import json
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from nvrx_core.inprocess.config import InProcessConfig
from nvrx_core.inprocess.rank_assignment import (Assignment, Policy, check_assignment, initial_assignment,
                                                   mark_terminated)
from nvrx_core.inprocess.records import Cause, InterruptionRecord

ACTIVE, RESERVE, OUT = "active", "reserve", "out"
FAULT_CAUSES = (Cause.EXCEPTION, Cause.SOFT_TIMEOUT)
EXCLUDED_BY_POLICY = "excluded_by_policy"


@dataclasses.dataclass(frozen=True)
class Plan:
    iteration: int
    assignment: Assignment
    faults: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """Faults caused so far, per initial rank."""
    causes: Mapping[int, str] = dataclasses.field(default_factory=dict)
    """Why each initial rank is out of the job (lost, health check, max_rank_faults, ...)."""
    marked: int = 0
    """Termination marks in the store when the plan was made: later marks interrupt the iteration."""
    give_up: Optional[str] = None
    previous: Tuple[InterruptionRecord, ...] = ()
    """What ended the previous iteration."""
    awaiting: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """Initial ranks whose process died and that the launcher replaces (respawn-rank), with the
    generation of the process that died: they keep their active rank, and the iteration starts
    once their replacements joined."""

    def role(self, rank: int) -> str:
        if rank in self.causes:
            return OUT
        return ACTIVE if self.assignment.active[rank] is not None else RESERVE

    def members(self) -> List[int]:
        """Initial ranks taking part in this iteration (active and reserves)."""
        return [r for r in range(self.assignment.initial_world_size) if r not in self.causes]

    def to_json(self) -> str:
        return json.dumps({
            "iteration": self.iteration,
            "active": [-1 if r is None else r for r in self.assignment.active],
            "faults": {str(r): n for r, n in self.faults.items()},
            "causes": {str(r): c for r, c in self.causes.items()},
            "marked": self.marked,
            "give_up": self.give_up,
            "previous": [json.loads(rec.to_json()) for rec in self.previous],
            "awaiting": {str(r): g for r, g in self.awaiting.items()},
        })

    @classmethod
    def from_json(cls, text: str, nodes: Sequence[str]) -> "Plan":
        data = json.loads(text)
        causes = {int(r): c for r, c in data["causes"].items()}
        active = tuple(None if r < 0 else r for r in data["active"])
        return cls(
            iteration=data["iteration"],
            assignment=Assignment(tuple(nodes), active, frozenset(causes)),
            faults={int(r): n for r, n in data["faults"].items()},
            causes=causes,
            marked=data["marked"],
            give_up=data["give_up"],
            previous=tuple(InterruptionRecord.from_json(json.dumps(rec)) for rec in data["previous"]),
            awaiting={int(r): g for r, g in data.get("awaiting", {}).items()},
        )


def faulty_ranks(records: Sequence[InterruptionRecord], new_marks: Mapping[int, str]) -> FrozenSet[int]:
    if new_marks:
        return frozenset(new_marks)
    return frozenset(rec.rank for rec in records if rec.first and rec.cause in FAULT_CAUSES)


def next_plan(previous: Plan, records: Sequence[InterruptionRecord], marks: Mapping[int, str],
              config: InProcessConfig, policy: Policy, marked: Optional[int] = None,
              generations: Optional[Mapping[int, int]] = None) -> Plan:
    """The plan of iteration previous.iteration + 1.

    `records`: interruptions recorded in the ended iteration; `marks`: every termination
    mark in the store (initial rank -> cause) not followed by a replacement; `marked`: how
    many declarations that was read from (default len(marks)). `generations` (respawn-rank:
    the launcher replaces a rank whose process died): each dead rank's process generation;
    such a rank keeps its place and its replacement is awaited.
    """
    new_marks = {r: c for r, c in marks.items() if r not in previous.causes}
    faults: Dict[int, int] = dict(previous.faults)
    faulty = faulty_ranks(records, new_marks)
    for rank in faulty:
        faults[rank] = faults.get(rank, 0) + 1
    marked = len(marks) if marked is None else marked
    if generations is not None:
        return _awaiting_replacements(previous, records, new_marks, faults, marked, config, generations)
    over_limit = sorted(r for r in faulty if r not in new_marks and config.max_rank_faults is not None
                        and faults[r] > config.max_rank_faults)
    causes: Dict[int, str] = {**previous.causes, **new_marks, **{r: Cause.MAX_RANK_FAULTS.value for r in over_limit}}
    lost = mark_terminated(previous.assignment, set(new_marks) | set(over_limit))
    assignment = check_assignment(policy(lost))
    for rank in assignment.terminated - set(causes):
        causes[rank] = EXCLUDED_BY_POLICY
    assignment = assignment.replace(terminated=frozenset(causes))
    iteration = previous.iteration + 1
    return Plan(iteration, assignment, faults, causes, marked,
                _give_up_reason(iteration, assignment, records, config), tuple(records))


def _awaiting_replacements(previous: Plan, records: Sequence[InterruptionRecord], new_marks: Mapping[int, str],
                           faults: Dict[int, int], marked: int, config: InProcessConfig,
                           generations: Mapping[int, int]) -> Plan:
    """Respawn-rank: nobody moves; the dead ranks' replacements take their places."""
    iteration = previous.iteration + 1
    return Plan(iteration, previous.assignment, faults, dict(previous.causes), marked,
                _give_up_reason(iteration, previous.assignment, records, config), tuple(records),
                {r: generations[r] for r in new_marks})


def _give_up_reason(iteration: int, assignment: Assignment, records: Sequence[InterruptionRecord],
                    config: InProcessConfig) -> Optional[str]:
    timeouts = [rec for rec in records if rec.cause == Cause.COMPLETION_TIMEOUT]
    if timeouts:
        return f"completion_timeout={config.completion_timeout} s expired ({timeouts[0].detail})"
    if config.max_iterations is not None and iteration >= config.max_iterations:
        return f"max_iterations={config.max_iterations} reached (the function was called {iteration} times)"
    if assignment.world_size < config.min_active_world_size:
        return (f"only {assignment.world_size} active ranks left, fewer than "
                f"min_active_world_size={config.min_active_world_size}")
    return None


def first_plan(nodes: Sequence[str], config: InProcessConfig) -> Plan:
    return Plan(0, initial_assignment(nodes, config.active_world_size))
