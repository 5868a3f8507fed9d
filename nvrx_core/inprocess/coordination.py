"""Store-based coordination between ranks, namespaced per restart iteration.

Keys (under the call's prefix P):
  P/node/<r>                  node name of initial rank r
  P/hb/<r>                    heartbeat counter of r (the watcher times changes on its own clock,
                              so clock skew between nodes does not matter)
  P/init                      arrivals at the first barrier
  P/term/<r>/<g>, P/term_list, P/term_count
                              process generation g of r is gone (first writer wins; list =
                              "r:cause\n" lines, and "r:revived\n" when a launcher's replacement
                              of r joined: r's generation is then P/gen/<r>)
  P/gen/<r>                   replacements of r that joined so far (its generation)
  P/await/<r>/<g>             the iteration whose plan waits for the replacement of r (generation g)
  P/it<k>/nrec, P/it<k>/rec   interruption records of iteration k (counter, JSON lines)
  P/it<k>/arrive, .../arrived restart barrier of iteration k (counter, "r," list)
  P/it<k>/plan                the next iteration's plan (first writer wins)
  P/it<k>/done                active ranks that finished iteration k
  P/it<k>/outcome             "completed" or "restart": how iteration k ended (first writer wins)
  P/it<k>/pg/...              the user's process group store for iteration k
  P/left                      ranks that left (the store host waits for them)

Counters are polled (one cheap request); lists are read only when the counters say a
barrier may be complete, so polling cost does not grow with the number of ranks.
"""

import logging
import time
import uuid
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch.distributed as dist

from nvrx_core.inprocess.errors import BarrierTimeout
from nvrx_core.inprocess.records import Cause, InterruptionRecord

logger = logging.getLogger("nvrx.inprocess")

POLL_MIN, POLL_MAX = 0.002, 0.05
# A wait that ends within its first second is a restart's critical path (a replacement joins
# in ~0.1 s); polling it at most this far apart keeps the overshoot small, and after the
# first second the store's load matters more than the latency.
POLL_MAX_FIRST_SECOND = 0.01
COMPLETED, RESTART = "completed", "restart"
REVIVED = "revived"


class Poller:
    """Sleeps between polls: fast at first (restarts are latency-critical), then backing off."""

    def __init__(self, sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic):
        self._sleep, self._clock = sleep, clock
        self._started = clock()
        self._delay = POLL_MIN

    def wait(self) -> None:
        self._sleep(self._delay)
        cap = POLL_MAX_FIRST_SECOND if self._clock() - self._started < 1.0 else POLL_MAX
        self._delay = min(cap, self._delay * 1.5)


class HeartbeatWatch:
    """Tracks when each watched counter last changed, on this process's monotonic clock.

    Silence counts only while the watcher could see: when no update came for `blind_after`
    seconds (the store did not answer, or this thread was not scheduled), the watched
    ranks' silence restarts at the next update. After a store stall, every counter is
    stale by the stall's length, and the ranks that wrote them are alive.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, blind_after: Optional[float] = None):
        self._clock = clock
        self.blind_after = blind_after
        self._seen: Dict[int, Tuple[bytes, float]] = {}
        self._last_update: Optional[float] = None

    def update(self, values: Dict[int, bytes]) -> None:
        now = self._clock()
        if self.blind_after is not None and self._last_update is not None and now - self._last_update > self.blind_after:
            self._seen = {rank: (value, now) for rank, (value, _) in self._seen.items()}
        self._last_update = now
        for rank, value in values.items():
            old = self._seen.get(rank)
            if old is None or old[0] != value:
                self._seen[rank] = (value, now)

    def stale(self, timeout: float) -> List[int]:
        now = self._clock()
        return sorted(r for r, (_, changed) in self._seen.items() if now - changed > timeout)


def blind_gap(heartbeat_interval: float) -> float:
    """How long a heartbeat watcher may go without reading before it stops trusting its silence timer."""
    return 2 * heartbeat_interval + 0.5


class Coordinator:
    """One client's view of the coordination keys of one Wrapper call."""

    def __init__(self, store: dist.Store, prefix: str, rank: int):
        self.store = store
        self.prefix = prefix
        self.rank = rank

    def key(self, *parts) -> str:
        return "/".join((self.prefix, *map(str, parts)))

    def iteration_prefix(self, iteration: int) -> str:
        return self.key(f"it{iteration}")

    # ---- presence ----------------------------------------------------------------
    def heartbeat(self) -> None:
        self.store.add(self.key("hb", self.rank), 1)

    def heartbeats(self, ranks: Sequence[int]) -> Dict[int, bytes]:
        if not ranks:
            return {}
        keys = [self.key("hb", r) for r in ranks]
        if not self.store.check(keys):  # a rank that never beat: create its counter rather than wait for it
            return {r: str(self.store.add(k, 0)).encode() for r, k in zip(ranks, keys)}
        return dict(zip(ranks, self.store.multi_get(keys)))

    def initial_barrier(self, node: str, world_size: int, timeout: float) -> List[str]:
        """Every initial rank announces itself and its node; returns the node of each rank."""
        self.store.set(self.key("node", self.rank), node)
        self.heartbeat()
        self.store.add(self.key("init"), 1)
        deadline, poller = time.monotonic() + timeout, Poller()
        while self.store.add(self.key("init"), 0) < world_size:
            if time.monotonic() > deadline:
                arrived = self.store.add(self.key("init"), 0)
                raise BarrierTimeout(f"only {arrived} of {world_size} ranks reached the first in-process "
                                     f"barrier within barrier_timeout={timeout} s")
            poller.wait()
        return self.node_names(world_size)

    # ---- termination ---------------------------------------------------------------
    def mark_terminated(self, rank: int, cause: Cause, detail: str = "", generation: Optional[int] = None) -> bool:
        """Declare `rank` gone; True if this call was the first to say so.

        `generation`: which process of the rank (0: the first; a launcher's replacement that
        joined is the next); by default the rank's current one. A declaration about a process
        that a replacement already succeeded then claims a settled key and changes nothing.
        """
        if generation is None:
            generation = self.generation(rank)
        claim = f"{self.rank}:{cause.value}:{uuid.uuid4().hex}"  # unique: a repeated claim must not win again
        if self.store.compare_set(self.key("term", rank, generation), "", claim).decode() != claim:
            return False
        self.store.append(self.key("term_list"), f"{rank}:{cause.value}\n")
        self.store.add(self.key("term_count"), 1)
        logger.warning("initial rank %d declared terminated (%s) by rank %d %s", rank, cause.value, self.rank, detail)
        return True

    def terminated_count(self) -> int:
        """Terminations declared so far (a revival does not lower it: it only ever grows)."""
        return self.store.add(self.key("term_count"), 0)

    def terminated(self) -> Dict[int, str]:
        """Initial rank -> cause, for every rank declared terminated and not revived since."""
        return self.terminations()[0]

    def terminations(self) -> Tuple[Dict[int, str], int]:
        """(terminated(), the number of declarations it was read from): one read of the list."""
        if not self.store.check([self.key("term_list")]):
            return {}, 0
        out: Dict[int, str] = {}
        declared = 0
        for line in self.store.get(self.key("term_list")).decode().splitlines():
            rank, _, cause = line.partition(":")
            if cause == REVIVED:
                out.pop(int(rank), None)
            else:
                declared += 1
                out.setdefault(int(rank), cause)
        return out, declared

    # ---- a launcher's replacement of a dead rank (ft_launcher --restart-policy respawn-rank) ----
    def generation(self, rank: int) -> int:
        return self.store.add(self.key("gen", rank), 0)

    def await_replacement(self, rank: int, generation: int, iteration: int) -> None:
        """Iteration `iteration` runs with a replacement of `rank` (the one after `generation`)."""
        self.store.set(self.key("await", rank, generation), str(iteration))

    def awaited_at(self, generation: int, timeout: float) -> int:
        """This rank is a replacement: the iteration whose plan waits for it."""
        key, deadline, poller = self.key("await", self.rank, generation), time.monotonic() + timeout, Poller()
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise BarrierTimeout(f"replacement of rank {self.rank}: no restart plan waited for it within "
                                     f"{timeout} s (the other ranks did not see rank {self.rank} die?)")
            poller.wait()
        return int(self.store.get(key))

    def revive(self) -> None:
        """This replacement takes its rank's place: no longer terminated, one generation on."""
        self.store.append(self.key("term_list"), f"{self.rank}:{REVIVED}\n")
        self.store.add(self.key("gen", self.rank), 1)

    def node_names(self, world_size: int) -> List[str]:
        """The node of each initial rank, as announced at the first barrier."""
        return [v.decode() for v in self.store.multi_get([self.key("node", r) for r in range(world_size)])]

    # ---- interruptions ---------------------------------------------------------------
    def record(self, iteration: int, cause: Cause, detail: str = "", rank: Optional[int] = None) -> InterruptionRecord:
        count = self.store.add(self.key(f"it{iteration}", "nrec"), 1)
        record = InterruptionRecord(self.rank if rank is None else rank, cause, detail, self.rank, first=count == 1)
        self.store.append(self.key(f"it{iteration}", "rec"), record.to_json() + "\n")
        return record

    def interruption_count(self, iteration: int) -> int:
        return self.store.add(self.key(f"it{iteration}", "nrec"), 0)

    def records(self, iteration: int) -> List[InterruptionRecord]:
        key = self.key(f"it{iteration}", "rec")
        if not self.store.check([key]):
            return []
        return [InterruptionRecord.from_json(line) for line in self.store.get(key).decode().splitlines() if line]

    def interrupted(self, iteration: int, terminated_base: int) -> bool:
        """Did anything end iteration `iteration`: a record, or a rank declared terminated?"""
        return self.interruption_count(iteration) > 0 or self.terminated_count() > terminated_base

    # ---- completion ------------------------------------------------------------------
    def mark_done(self, iteration: int) -> None:
        self.store.add(self.key(f"it{iteration}", "done"), 1)

    def settle(self, iteration: int, outcome: str) -> str:
        """Propose how iteration `iteration` ended (COMPLETED or RESTART); every rank gets the first proposal.

        A rank that saw every active rank done and a rank that saw an interruption record
        (written as the last rank returned) would otherwise end the iteration differently.
        """
        return self.store.compare_set(self.key(f"it{iteration}", "outcome"), "", outcome).decode()

    def done_count(self, iteration: int) -> int:
        return self.store.add(self.key(f"it{iteration}", "done"), 0)

    # ---- restart barrier ---------------------------------------------------------------
    def arrive(self, iteration: int) -> None:
        self.store.append(self.key(f"it{iteration}", "arrived"), f"{self.rank},")
        self.store.add(self.key(f"it{iteration}", "arrive"), 1)

    def arrived(self, iteration: int) -> Set[int]:
        key = self.key(f"it{iteration}", "arrived")
        if not self.store.check([key]):
            return set()
        text = self.store.get(key).decode()
        return {int(r) for r in text.split(",") if r}

    def wait_for_members(self, iteration: int, members: Iterable[int], terminated_base: int, timeout: float,
                         heartbeat_timeout: float, heartbeat_interval: float,
                         on_lost: Callable[[int], None]) -> Tuple[Set[int], Dict[int, str]]:
        """Wait until each member of `iteration` has arrived or is declared terminated, or
        another rank has made the next plan already.

        The last: a rank that saw the barrier complete made the plan, and a replacement it
        awaits may have taken a dead member's place since (respawn-rank): that member is then
        neither terminated nor arrived, and only the plan ends the wait.
        Members silent for heartbeat_timeout are declared lost (on_lost(rank) does it).
        Returns (arrived, terminated-so-far).
        """
        members = set(members)
        deadline, poller = time.monotonic() + timeout, Poller()
        watch, next_scan = HeartbeatWatch(blind_after=blind_gap(heartbeat_interval)), 0.0
        planned = self.key(f"it{iteration}", "plan")
        while True:
            arrivals = self.store.add(self.key(f"it{iteration}", "arrive"), 0)
            new_terms = self.terminated_count() - terminated_base
            if arrivals + new_terms >= len(members):
                arrived, terminated = self.arrived(iteration), self.terminated()
                if members <= arrived | set(terminated) or self.store.check([planned]):
                    return arrived, terminated
            now = time.monotonic()
            if now > deadline:
                missing = sorted(members - self.arrived(iteration) - set(self.terminated()))
                raise BarrierTimeout(f"restart barrier of iteration {iteration}: ranks {missing[:20]} did not "
                                     f"arrive within barrier_timeout={timeout} s")
            if now >= next_scan:
                next_scan = now + heartbeat_interval
                waiting_for = sorted(members - set(self.terminated()))
                watch.update(self.heartbeats(waiting_for))
                for rank in watch.stale(heartbeat_timeout):
                    if rank in waiting_for:
                        on_lost(rank)
            poller.wait()

    def propose_plan(self, iteration: int, plan_json: str) -> str:
        """First proposal wins; everyone gets the winning plan back."""
        return self.store.compare_set(self.key(f"it{iteration}", "plan"), "", plan_json).decode()

    def wait_for_plan(self, iteration: int, timeout: float) -> str:
        key, deadline, poller = self.key(f"it{iteration}", "plan"), time.monotonic() + timeout, Poller()
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise BarrierTimeout(f"no restart plan for iteration {iteration + 1} within {timeout} s")
            poller.wait()
        return self.store.get(key).decode()

    # ---- leaving ---------------------------------------------------------------------
    def leave(self) -> None:
        self.store.add(self.key("left"), 1)

    def wait_for_leavers(self, expected: int, timeout: float) -> int:
        deadline, poller = time.monotonic() + timeout, Poller()
        while (left := self.store.add(self.key("left"), 0)) < expected and time.monotonic() < deadline:
            poller.wait()
        return left
