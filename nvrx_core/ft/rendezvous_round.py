"""Who is in a rendezvous round, and with which group rank: a pure decision.

The barrier rendezvous (`rendezvous.py`) gathers arrivals in the store; this module decides,
from those arrivals, the previous round and which nodes are known lost, whether the round can
close and how. Kept free of any store so every rule is tested directly.

The rules, in the order they apply:
- a node of the previous round keeps its slot (its group rank when the world is full);
- with infrastructure ranks, a node whose infra rank is below the maximum owns that slot
  unless a spare holds it; two live nodes claiming one infra rank is an error naming both;
- a slot whose owner is lost is taken by a spare: the lowest infra rank first, else the
  earliest arrival; without infra ranks a new node also fills any slot never taken;
- the round waits for every previous participant that is not known lost;
- it closes when every slot is filled, or, with at least the minimum, when this is a restart
  round (nobody else is expected) or the first round's last call has passed.
Group ranks are the filled slots in order, so a full world keeps every slot's rank.
"""

import dataclasses
import json
from typing import Dict, List, Optional, Sequence, Set, Tuple

from torch.distributed.elastic.rendezvous import RendezvousError


class RendezvousConflictError(RendezvousError):
    """Nodes of one job disagree in a way no round can resolve (two claim one infra rank)."""


@dataclasses.dataclass(frozen=True)
class Arrival:
    """What a node writes when it arrives in a round."""

    node: str  # unique per launcher process: host, pid and a random suffix
    infra_rank: Optional[int] = None
    index: int = 0  # arrival order in the round, from 1

    def to_json(self) -> str:
        return json.dumps({"node": self.node, "infra_rank": self.infra_rank})

    @classmethod
    def from_json(cls, text: str, index: int) -> "Arrival":
        data = json.loads(text)
        return cls(node=data["node"], infra_rank=data.get("infra_rank"), index=index)


@dataclasses.dataclass
class RoundResult:
    """A closed round: slot -> node for participants; everyone else who arrived waits."""

    round: int
    slots: Dict[int, str]
    spares: List[str] = dataclasses.field(default_factory=list)
    lost: List[str] = dataclasses.field(default_factory=list)  # previous participants not in this round
    activated: List[str] = dataclasses.field(default_factory=list)  # took the slot of a lost node
    infra_ranks: Dict[str, int] = dataclasses.field(default_factory=dict)  # participants', when used
    _rank_of: Optional[Dict[str, int]] = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return len(self.slots)

    def group_rank(self, node: str) -> Optional[int]:
        return self._ranks().get(node)

    def nodes(self) -> List[str]:
        """Participants in group-rank order."""
        return list(self._ranks())

    def _ranks(self) -> Dict[str, int]:
        # computed once: every node of a large job asks for its own rank in the same result
        if self._rank_of is None:
            self._rank_of = {self.slots[slot]: rank for rank, slot in enumerate(sorted(self.slots))}
        return self._rank_of

    def to_json(self) -> str:
        return json.dumps({"round": self.round, "slots": {str(k): v for k, v in self.slots.items()},
                           "spares": self.spares, "lost": self.lost, "activated": self.activated,
                           "infra_ranks": self.infra_ranks})

    @classmethod
    def from_json(cls, text: str) -> "RoundResult":
        data = json.loads(text)
        return cls(round=data["round"], slots={int(k): v for k, v in data["slots"].items()},
                   spares=data["spares"], lost=data["lost"], activated=data["activated"],
                   infra_ranks=data.get("infra_ranks", {}))


@dataclasses.dataclass(frozen=True)
class Membership:
    """One node's place in a closed round: what the node needs, small enough that each of
    thousands of nodes reads only its own."""

    round: int
    group_rank: Optional[int]  # None: a spare
    world_size: int
    watch: Tuple[str, ...] = ()  # the nodes whose heartbeat this one watches
    activated: bool = False  # took a lost node's slot

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Membership":
        data = json.loads(text)
        return cls(**{**data, "watch": tuple(data["watch"])})


def membership(result: RoundResult, node: str, watched: int = 2) -> Membership:
    """`node`'s membership; a participant watches the next `watched` nodes in rank order."""
    rank = result.group_rank(node)
    if rank is None:
        return Membership(result.round, None, result.world_size)
    nodes = result.nodes()
    following = dict.fromkeys(nodes[(rank + k) % len(nodes)] for k in range(1, watched + 1))
    watch = tuple(n for n in following if n != node)
    return Membership(result.round, rank, result.world_size, watch, node in result.activated)


def plan_round(round_number: int, arrivals: Sequence[Arrival], previous: Optional[RoundResult],
               lost: Set[str], min_nodes: int, max_nodes: int, last_call_passed: bool,
               use_infra_rank: bool, alive: Set[str] = frozenset()) -> Optional[RoundResult]:
    """The round's result, or None while it must wait for more nodes.

    `alive`: previous participants not arrived yet but seen alive just now (their heartbeat
    moves); a newcomer claiming one of their infra ranks is a conflict, not a replacement."""
    before = dict(previous.slots) if previous else {}
    if use_infra_rank:
        here = {a.node for a in arrivals}
        holders = {n: r for n, r in (previous.infra_ranks if previous else {}).items() if n in here or n in alive}
        _check_infra_ranks(arrivals, holders)
    here = {a.node: a for a in arrivals}
    pending = [n for n in before.values() if n not in here and n not in lost]
    if pending:
        return None
    slots: Dict[int, str] = {slot: node for slot, node in before.items() if node in here}
    vacated = [slot for slot, node in sorted(before.items()) if node not in here]
    newcomers = [a for a in sorted(arrivals, key=lambda a: a.index) if a.node not in before.values()]
    if use_infra_rank:
        for a in newcomers:
            if a.infra_rank < max_nodes and a.infra_rank not in slots:  # else a spare took it: wait
                slots[a.infra_rank] = a.node
        waiting = sorted((a for a in newcomers if a.node not in slots.values()),
                         key=lambda a: (a.infra_rank, a.index))
    else:
        waiting = list(newcomers)
    activated = []
    for slot in vacated:  # a lost node's slot goes to a spare
        if slot not in slots and waiting:
            slots[slot] = waiting.pop(0).node
            activated.append(slots[slot])
    if not use_infra_rank or last_call_passed:  # free slots nobody owns
        for slot in range(max_nodes):
            if slot not in slots and waiting:
                slots[slot] = waiting.pop(0).node
    full = len(slots) >= max_nodes
    restart_round = previous is not None
    if not (full or (len(slots) >= min_nodes and (restart_round or last_call_passed))):
        return None
    infra = {node: here[node].infra_rank for node in slots.values()} if use_infra_rank else {}
    return RoundResult(round=round_number, slots=slots, spares=[a.node for a in waiting],
                       lost=sorted(n for n in before.values() if n not in here), activated=activated,
                       infra_ranks=infra)


def _check_infra_ranks(arrivals: Sequence[Arrival], participants: Dict[str, int]) -> None:
    """Every node has an infra rank and no two live nodes share one (participants: the previous
    round's known alive, arrived or not)."""
    claimed: Dict[int, str] = {rank: node for node, rank in participants.items()}
    for a in arrivals:
        if a.infra_rank is None:
            raise RendezvousConflictError(f"node {a.node} has no infra group rank, but the job uses them")
        if a.infra_rank in claimed and claimed[a.infra_rank] != a.node:
            raise RendezvousConflictError(
                f"nodes {claimed[a.infra_rank]} and {a.node} both claim infra group rank {a.infra_rank}")
        claimed[a.infra_rank] = a.node
