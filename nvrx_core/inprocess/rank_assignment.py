"""Rank assignment after a fault: small pure policies over one immutable Assignment.

An Assignment is indexed by *initial* rank (the rank a process had when the Wrapper
started). After a fault the Wrapper marks the lost ranks terminated; their active slots
become gaps, and a policy pipeline decides who fills them:

    compose(KeepWholeNodes(), ActivateReserves(), ShiftRanks())

Every policy is a plain callable Assignment -> Assignment with no I/O and no hidden state,
so all ranks (or the one rank that decides for all) get the same answer, tests can drive
them directly, and each runs in O(world size) (16k ranks take milliseconds).
"""

import dataclasses
import socket
from typing import Callable, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple

from nvrx_core import dist_env

Policy = Callable[["Assignment"], "Assignment"]


class RankAssignmentError(RuntimeError):
    """A policy produced an assignment that breaks an invariant (duplicate or missing ranks)."""


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Which process has which active rank in one restart iteration.

    `active[i]` is the active rank of initial rank i, or None for a warm reserve (alive,
    waiting) or a terminated rank. A terminated rank may still hold its old active rank
    between `mark_terminated` and the policies that close the gap.
    """

    nodes: Tuple[str, ...]
    active: Tuple[Optional[int], ...]
    terminated: FrozenSet[int] = frozenset()

    def __post_init__(self):
        if len(self.nodes) != len(self.active):
            raise RankAssignmentError(f"{len(self.nodes)} node names for {len(self.active)} ranks")

    @property
    def initial_world_size(self) -> int:
        return len(self.active)

    @property
    def world_size(self) -> int:
        """Active ranks that are alive (gaps not counted)."""
        return sum(1 for i, r in enumerate(self.active) if r is not None and i not in self.terminated)

    def alive(self) -> List[int]:
        return [i for i in range(len(self.active)) if i not in self.terminated]

    def reserves(self) -> List[int]:
        """Alive ranks without an active rank, in initial-rank order."""
        return [i for i, r in enumerate(self.active) if r is None and i not in self.terminated]

    def gaps(self) -> List[int]:
        """Active ranks held by terminated processes, ascending."""
        return sorted(r for i, r in enumerate(self.active) if r is not None and i in self.terminated)

    def replace(self, **changes) -> "Assignment":
        return dataclasses.replace(self, **changes)


def initial_assignment(nodes: Sequence[str], active_world_size: Optional[int] = None) -> Assignment:
    """The first `active_world_size` initial ranks are active, the rest are reserves."""
    world = len(nodes)
    active_count = world if active_world_size is None else active_world_size
    if not 0 < active_count <= world:
        raise RankAssignmentError(f"active_world_size={active_count}: need 1 <= it <= world size {world}")
    return Assignment(tuple(nodes), tuple(i if i < active_count else None for i in range(world)))


def mark_terminated(assignment: Assignment, ranks: Iterable[int]) -> Assignment:
    """Record newly lost initial ranks; their active ranks become gaps for the policies."""
    ranks = frozenset(ranks)
    bad = sorted(r for r in ranks if not 0 <= r < assignment.initial_world_size)
    if bad:
        raise RankAssignmentError(f"terminated ranks {bad} are outside 0..{assignment.initial_world_size - 1}")
    return assignment.replace(terminated=assignment.terminated | ranks)


def compose(*policies: Policy) -> Policy:
    """Apply `policies` left to right."""

    def composed(assignment: Assignment) -> Assignment:
        for policy in policies:
            assignment = policy(assignment)
        return assignment

    composed.policies = policies  # type: ignore[attr-defined]
    return composed


class KeepWholeNodes:
    """A fault on a node excludes the whole node (granularity "node").

    For faults that usually mean the machine is bad (a GPU fell off the bus, a NIC died),
    or for jobs whose parallel layout needs full nodes.
    """

    def __call__(self, assignment: Assignment) -> Assignment:
        bad_nodes = {assignment.nodes[i] for i in assignment.terminated}
        if not bad_nodes:
            return assignment
        extra = {i for i, node in enumerate(assignment.nodes) if node in bad_nodes}
        return assignment.replace(terminated=assignment.terminated | frozenset(extra))


class ActivateReserves:
    """Fill gaps with warm reserves (lowest initial rank first); the world size is kept.

    Gaps left when reserves run out stay open for a later policy (ShiftRanks or
    FillGapsFromTop) to close.
    """

    def __call__(self, assignment: Assignment) -> Assignment:
        reserves = assignment.reserves()
        holders = sorted((r, i) for i, r in enumerate(assignment.active)
                         if r is not None and i in assignment.terminated)
        if not holders or not reserves:
            return assignment
        active = list(assignment.active)
        for (gap, holder), reserve in zip(holders, reserves):
            active[holder] = None
            active[reserve] = gap
        return assignment.replace(active=tuple(active))


class FillGapsFromTop:
    """Move the highest active ranks down into the gaps; everyone else keeps its rank.

    Fewer ranks change number than with ShiftRanks (useful when rank -> data shard or
    rank -> pipeline stage mappings are expensive to rebuild); the world shrinks.
    """

    def __call__(self, assignment: Assignment) -> Assignment:
        gaps = assignment.gaps()
        if not gaps:
            return assignment
        active = list(assignment.active)
        for i in assignment.terminated:
            active[i] = None
        by_rank = sorted((i for i, r in enumerate(active) if r is not None), key=active.__getitem__)
        for gap in gaps:
            if not by_rank or active[by_rank[-1]] < gap:
                break
            mover = by_rank.pop()
            active[mover] = gap
        return assignment.replace(active=tuple(active))


class ShiftRanks:
    """Close every gap by shifting the ranks above it down, keeping their order."""

    def __call__(self, assignment: Assignment) -> Assignment:
        active = list(assignment.active)
        for i in assignment.terminated:
            active[i] = None
        order = sorted((i for i, r in enumerate(active) if r is not None), key=active.__getitem__)
        for new_rank, i in enumerate(order):
            active[i] = new_rank
        return assignment.replace(active=tuple(active))


class LimitWorldSize:
    """At most `max_world_size` active ranks; the highest ones above it become reserves."""

    def __init__(self, max_world_size: int):
        if max_world_size < 1:
            raise ValueError(f"max_world_size={max_world_size}: must be >= 1")
        self.max_world_size = max_world_size

    def __call__(self, assignment: Assignment) -> Assignment:
        return _deactivate_above(assignment, self.max_world_size)


class DivisibleBy:
    """Active world size rounded down to a multiple of `divisor` (e.g. tensor x pipeline size)."""

    def __init__(self, divisor: int):
        if divisor < 1:
            raise ValueError(f"divisor={divisor}: must be >= 1")
        self.divisor = divisor

    def __call__(self, assignment: Assignment) -> Assignment:
        size = assignment.world_size
        return _deactivate_above(assignment, size - size % self.divisor)


def node_of(env: Mapping[str, str], rank: int) -> str:
    """The node a rank belongs to, for granularity "node" (same answer on every rank of a node).

    GROUP_RANK (torchrun / ft_launcher's node rank) when set; else the block of
    LOCAL_WORLD_SIZE consecutive ranks this rank falls in (launchers number a node's ranks
    consecutively; a node's rank count is LOCAL_WORLD_SIZE, not its GPU count, so CPU jobs
    and jobs using some of a node's GPUs are grouped right); else the host name. A
    LOCAL_WORLD_SIZE that is set but invalid is a ConfigError (dist_env's rule): read as
    unset, it would put every rank of a multi-node job on one "node" of the host name.
    """
    if env.get("GROUP_RANK"):
        return env["GROUP_RANK"]
    local_world = dist_env.local_world_size(env, optional=True)
    if local_world is not None:
        return f"ranks-{rank // local_world * local_world}+{local_world}"
    return socket.gethostname()


def default_policy(granularity: str) -> Policy:
    """The Wrapper's pipeline: (whole nodes,) reserves first, then shift the rest down."""
    steps: List[Policy] = [KeepWholeNodes()] if granularity == "node" else []
    return compose(*steps, ActivateReserves(), ShiftRanks())


def check_assignment(assignment: Assignment) -> Assignment:
    """Raise unless active ranks of alive processes are exactly 0..W-1 and no gap is left."""
    seen = [False] * len(assignment.active)
    for i, r in enumerate(assignment.active):
        if r is None:
            continue
        if i in assignment.terminated:
            raise RankAssignmentError(f"terminated initial rank {i} still holds active rank {r} (gap not closed)")
        if not 0 <= r < len(seen) or seen[r]:
            raise RankAssignmentError(f"active rank {r} of initial rank {i} is out of range or duplicated")
        seen[r] = True
    world = assignment.world_size
    if not all(seen[:world]) or any(seen[world:]):
        raise RankAssignmentError(f"active ranks are not 0..{world - 1}")
    return assignment


def _deactivate_above(assignment: Assignment, limit: int) -> Assignment:
    active = list(assignment.active)
    for i, r in enumerate(active):
        if r is not None and i not in assignment.terminated and r >= limit:
            active[i] = None
    return ShiftRanks()(assignment.replace(active=tuple(active)))
