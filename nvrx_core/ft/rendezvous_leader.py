"""The deciding side of a barrier rendezvous round (see rendezvous.py), and heartbeat liveness.

A round's leader (its first arrival, or whoever takes over when the leader is lost) gathers
the arrivals and the previous round's participants' liveness, asks `plan_round` whether the
round can close, and writes the result and each arrival's own membership.
"""

import logging
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set

from torch.distributed import Store

from nvrx_core import events as ev
from nvrx_core.ft.rendezvous_round import Arrival, RendezvousConflictError, RoundResult, membership, plan_round

if TYPE_CHECKING:
    from nvrx_core.ft.rendezvous import BarrierRendezvousHandler

logger = logging.getLogger("nvrx.ft.rendezvous")


class Liveness:
    """Tells a lost node from a live one by whether its heartbeat counter moves."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic):
        self.timeout = timeout
        self.clock = clock
        self._seen: Dict[str, tuple] = {}  # node -> (counter, when it last changed, seen changing)

    def observe(self, counters: Dict[str, int]) -> None:
        now = self.clock()
        for node, value in counters.items():
            last = self._seen.get(node)
            if last is None:
                self._seen[node] = (value, now, False)
            elif last[0] != value:
                self._seen[node] = (value, now, True)

    def lost(self, node: str) -> bool:
        """Unchanged for the whole timeout (the caller keeps observing it)."""
        last = self._seen.get(node)
        return last is not None and self.clock() - last[1] > self.timeout

    def moved_since(self, node: str, when: float) -> bool:
        """Seen changing (not merely seen) after `when`: certainly alive then."""
        last = self._seen.get(node)
        return last is not None and last[2] and last[1] > when


class RoundDecider:
    """The leader's side of one round: gathers arrivals and liveness, asks plan_round.

    Every time it reads (when the round opened, since when it is short of nodes, the newest
    arrival, a leader's liveness) comes from the handler's `clock`, so join_timeout,
    last_call_timeout and a take-over are decided on whatever clock the handler was given."""

    def __init__(self, handler: "BarrierRendezvousHandler", round_number: int, leading: bool):
        self.h = handler
        self.store = handler._store
        self.clock = handler.clock
        self.round = round_number
        self.arrivals: List[Arrival] = []
        self.liveness = Liveness(handler.settings.node_timeout, self.clock)
        self.previous: Optional[RoundResult] = None
        self.previous_read = False
        self.opened = self.clock()
        self.short_since: Optional[float] = None
        self.leading = leading  # once this node leads a round it stays the leader
        self.dead: Set[str] = set()  # arrivals known lost since (a leader that died before deciding)
        self.reported: Set[str] = set()  # nodes this leader found lost (each reported once)
        self.newest_arrival_seen = 0.0

    def take_over_if_leader_lost(self) -> None:
        key = f"{self.round}/leader"
        if self.leading:
            return
        leader = self.store.get(key).decode() if self.store.check([key]) else ""
        if leader:
            self.liveness.observe({leader: counters(self.store, [leader])[0]})
            if not self.liveness.lost(leader):
                return
            self.dead.add(leader)
        elif self.clock() - self.opened < self.h.settings.node_timeout:
            return
        self.leading = self.store.compare_set(key, leader, self.h.node).decode() == self.h.node
        if self.leading:
            logger.warning("round %d: leader %s lost; %s decides the round", self.round, leader or "-", self.h.node)

    def decide_and_assign(self) -> bool:
        """Decide the round if it can close; write the result, then each arrival's membership."""
        decision = self.decide()
        if decision is None:
            return False
        written = self.store.compare_set(f"{self.round}/result", "", decision).decode()
        if written == decision:  # not a second leader's, decided a moment earlier
            keys = [f"{self.round}/assign/{a.index}" for a in self.arrivals]
            if decision.startswith("error:"):
                values = [decision] * len(keys)
            else:
                result = RoundResult.from_json(decision)
                values = [membership(result, a.node).to_json() for a in self.arrivals]
            self.store.multi_set(keys, values)
        return True

    def decide(self) -> Optional[str]:
        settings = self.h.settings
        self._read_new_arrivals()
        previous = self._previous()
        lost = set(self._marked_lost())
        alive: Set[str] = set()
        if previous:
            here = {a.node for a in self.arrivals}
            pending = [n for n in previous.nodes() if n not in here and n not in lost]
            if pending:
                self.liveness.observe(dict(zip(pending, counters(self.store, pending))))
                for node in pending:
                    if self.liveness.lost(node):
                        lost.add(node)
                        if node not in self.reported:
                            self.reported.add(node)
                            self.h._emit(ev.NODE_LOST, round=self.round - 1, lost_agent=node, seen_by="leader")
                # alive after the newest node arrived: a claim on its infra rank is a conflict, not a
                # replacement (a node that died just before a replacement came never moves again)
                alive = {n for n in pending if self.liveness.moved_since(n, self.newest_arrival_seen)}
        now = self.clock()
        arrived = [a for a in self.arrivals if a.node not in self.dead]
        try:
            result = plan_round(self.round, arrived, previous, lost, settings.min_nodes, settings.max_nodes,
                                last_call_passed=now - self.opened > settings.last_call_timeout,
                                use_infra_rank=settings.infra_rank is not None, alive=alive)
        except RendezvousConflictError as e:
            return f"error:{e}"
        if result is not None:
            return result.to_json()
        waiting_on_live_nodes = previous is not None and any(
            n not in lost and n not in {a.node for a in arrived} for n in previous.nodes())
        self.short_since = None if waiting_on_live_nodes else (self.short_since or now)
        if self.short_since is not None and now - self.short_since > settings.join_timeout:
            return (f"error:timeout:round {self.round}: {len(arrived)} node(s) arrived, "
                    f"{settings.min_nodes} needed, none more within join_timeout={settings.join_timeout:g} s")
        return None

    def _read_new_arrivals(self) -> None:
        count = self.store.add(f"{self.round}/arrived", 0)
        known = len(self.arrivals)
        if count > known:
            keys = [f"{self.round}/node/{i}" for i in range(known + 1, count + 1)]
            for i, raw in enumerate(self.store.multi_get(keys), start=known + 1):
                self.arrivals.append(Arrival.from_json(raw.decode(), i))
            self.newest_arrival_seen = self.clock()

    def _previous(self) -> Optional[RoundResult]:
        if not self.previous_read and self.round > 1:
            key = f"{self.round - 1}/result"
            if self.store.check([key]):
                text = self.store.get(key).decode()
                self.previous = None if text.startswith("error:") else RoundResult.from_json(text)
                self.previous_read = True
        return self.previous

    def _marked_lost(self) -> List[str]:
        if self.round == 1:
            return []
        count = self.store.add(f"{self.round - 1}/lost/count", 0)
        keys = [f"{self.round - 1}/lost/{i}" for i in range(1, count + 1)]
        return [raw.decode() for raw in self.store.multi_get(keys)] if keys else []


def counters(store: Store, nodes: List[str]) -> List[int]:
    return [int(raw.decode() or 0) for raw in store.multi_get([f"hb/{n}" for n in nodes])]
