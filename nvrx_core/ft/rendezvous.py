"""Barrier rendezvous: rounds on the c10d TCPStore, hot spare nodes, ranks that stay put.

torch's c10d handler keeps one state blob that every node rewrites by compare-and-set, so
a round costs more than linearly in the node count, and it hands out group ranks afresh
in each round. Here a node arrives with one atomic add in a key namespace of its own
round; the round's first arrival (its leader) decides the round once, from the arrivals
(`rendezvous_round.plan_round`), and everyone reads that one result. Nodes beyond
--nnodes' maximum wait as hot spares in the next round; a spare takes exactly the slot of
a node that was lost, so every surviving node keeps its group rank.

A node is lost when its heartbeat (a counter each agent bumps in the store: no clocks need
agree) stops changing for `node_timeout` seconds. During training each node watches the
next two nodes of the round; a node it finds lost is written to the round, every node sees
that within a heartbeat and restarts its workers (torch's agent restarts when
`num_nodes_waiting()` is positive), and the next round gives the slot to a spare.

Selected with `--rdzv-backend nvrx`; ft_launcher also uses it for `c10d` unless
`--ft-rdzv-impl legacy`. Options come through --rdzv-conf: join_timeout, last_call_timeout,
heartbeat_interval, node_timeout. The store lives in the agent whose host matches the
endpoint, as with torch's c10d backend: losing that node ends the job.
"""

import dataclasses
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Callable, Optional

from torch.distributed import DistNetworkError, PrefixStore, Store
from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousConnectionError,
                                                  RendezvousGracefulExitError,
                                                  RendezvousHandler, RendezvousInfo, RendezvousParameters,
                                                  RendezvousStoreInfo, RendezvousTimeoutError,
                                                  rendezvous_handler_registry)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

from nvrx_core import events as ev
from nvrx_core.config import ConfigError, check
from nvrx_core.ft.rendezvous_leader import Liveness, RoundDecider, counters
from nvrx_core.ft.rendezvous_round import Arrival, Membership, RendezvousConflictError, RoundResult, membership

logger = logging.getLogger("nvrx.ft.rendezvous")

BACKEND = "nvrx"
_FINISHED = "finished"
POLL_BUDGET = 2000.0
"""Store requests per second that a round's waiting nodes may make in all: a node waiting for
its assignment polls every 0.2 s, or every (its arrival number / POLL_BUDGET) seconds once the
round is that large. One TCPStore thread serves every node, so a fixed rate per node would
load it in proportion to the node count for as long as the round takes, which itself grows
with the node count; under the budget a round costs the store work linear in the nodes."""
FIRST_POLL = 0.02
MIN_POLL = 0.2
SLOW_CHECK_REQUESTS = 4
"""Store requests of a waiting node's slower look (closed? decided? leader alive?), made every
heartbeat interval, or less often in a round so large that they would exceed the budget."""


@dataclasses.dataclass
class BarrierSettings:
    run_id: str
    min_nodes: int
    max_nodes: int
    infra_rank: Optional[int] = None  # set when ranks follow the scheduler's (--ft-use-infra-group-rank)
    local_addr: Optional[str] = None
    endpoint: str = ""
    join_timeout: float = 600.0  # a round short of nodes (and no spare coming) fails after this
    last_call_timeout: float = 30.0  # first round: wait this long past the minimum for more nodes
    heartbeat_interval: float = 1.0
    node_timeout: float = 4.0  # a heartbeat unchanged this long: the node is lost

    def __post_init__(self):
        check(0 < self.min_nodes <= self.max_nodes, "--nnodes", f"{self.min_nodes}:{self.max_nodes}",
              "need 0 < min <= max")
        check(self.infra_rank is None or self.infra_rank >= 0, "infra group rank", self.infra_rank, "must be >= 0")
        for name in ("join_timeout", "last_call_timeout", "heartbeat_interval", "node_timeout"):
            check(getattr(self, name) > 0, f"--rdzv-conf {name}", getattr(self, name), "must be > 0 seconds")
        check(self.node_timeout >= 2 * self.heartbeat_interval, "--rdzv-conf node_timeout", self.node_timeout,
              f"must be at least twice heartbeat_interval ({self.heartbeat_interval})")

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> "BarrierSettings":
        def seconds(name: str) -> float:
            value = params.get(name, getattr(cls, name))
            try:
                return float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"--rdzv-conf {name}={value!r}: expected seconds") from None

        infra = params.get("infra_group_rank")
        return cls(run_id=params.run_id, min_nodes=params.min_nodes, max_nodes=params.max_nodes,
                   infra_rank=None if infra is None else int(infra), local_addr=params.local_addr,
                   endpoint=params.endpoint,
                   **{name: seconds(name) for name in ("join_timeout", "last_call_timeout",
                                                       "heartbeat_interval", "node_timeout")})


class BarrierRendezvousHandler(RendezvousHandler):
    """One node's side of the barrier rendezvous.

    `clock` (monotonic seconds) is what every decision about time reads: a node lost, a round's
    join_timeout and last_call_timeout, a leader taken over, how often a waiting node looks
    again; a test passes a fake clock it advances, so these verdicts never depend on how late a
    loaded host woke a thread. Waits that only bound a hang (shutdown's wait for the other nodes
    to leave, the sleep between polls) stay on real time.

    `heartbeat_thread=False`: no heartbeat thread is started; whoever made the handler calls
    `beat()` instead (a test, once per step of its fake clock), so a live node never looks lost.
    """

    def __init__(self, store: Store, settings: BarrierSettings, *, clock: Callable[[], float] = time.monotonic,
                 heartbeat_thread: bool = True):
        self.settings = settings
        self.clock = clock
        self.node = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.events: Optional[ev.EventLog] = None  # set by the launcher
        self._store = PrefixStore(f"nvrx_rdzv/{settings.run_id}/", store)
        self._current: Optional[Membership] = None
        self._lost_in_round: Optional[int] = None  # the round in which a node was found lost
        self._liveness = Liveness(settings.node_timeout, clock)  # this node's peers, as its beats watch them
        self._heartbeat_thread = heartbeat_thread
        self._registered = False  # counted in nodes_joined, heartbeat counter created
        self._stop = threading.Event()
        self._pulse: Optional[threading.Thread] = None

    # ---- RendezvousHandler ---------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.settings.run_id

    @property
    def use_agent_store(self) -> bool:
        return False

    def is_closed(self) -> bool:
        return self._store.check(["closed"])

    def set_closed(self) -> None:
        self._store.set("closed", "closed")

    def finish(self) -> None:
        """The job succeeded: waiting spares exit 0 instead of failing. A node that finished a
        little later than the store's host may find the store gone: its training is still done."""
        try:
            self._store.set("closed", _FINISHED)
        except DistNetworkError as e:
            logger.info("the rendezvous store's host already left (the job is done): %s", _first_line(e))

    def shutdown(self) -> bool:
        """Close the rendezvous and leave. The store lives in one of the agents, which cannot tell
        it is that one; so every agent waits (a few heartbeats at most) until every node that
        joined has left too, and no node loses the store before it has read how things ended."""
        self.stop_heartbeat()
        try:
            if not self.is_closed():
                self.set_closed()
            if self._registered:
                joined = self._store.add("nodes_joined", 0)
                left = self._store.add("nodes_left", 1)
                deadline = time.monotonic() + 2 * self.settings.heartbeat_interval + 1.0
                while left < joined and time.monotonic() < deadline:
                    time.sleep(0.05)
                    left = self._store.add("nodes_left", 0)
        except DistNetworkError as e:  # the store's host is gone already: nothing left to close
            logger.info("the rendezvous store's host already left: %s", _first_line(e))
        except Exception as e:
            logger.warning("could not close the rendezvous: %s", _first_line(e))
        return True

    def stop_heartbeat(self, timeout: float = 5.0) -> None:
        """Stop the heartbeat thread and wait for it (also where the rendezvous stays open for
        other nodes, as after a stop signal). A daemon thread still inside a store call when the
        interpreter finalizes is ended by pthread_exit in torch's C++ code, which aborts the
        process ("terminate called without an active exception", exit 134: seen on Slurm)."""
        self._stop.set()
        if self._pulse is not None and self._pulse is not threading.current_thread():
            self._pulse.join(timeout)

    def last_round(self) -> Optional[RoundResult]:
        """The whole result of the last round this node joined (read from the store)."""
        if self._current is None:
            return None
        return RoundResult.from_json(self._store.get(f"{self._current.round}/result").decode())

    def num_nodes_waiting(self) -> int:
        """Positive when the workers should restart: a node of this round was lost, or the world
        is below its maximum and nodes wait to join."""
        current = self._current
        if current is None:
            return 0
        if self._lost_in_round == current.round:
            return 1
        if current.world_size >= self.settings.max_nodes:
            return 0
        return self._store.add(f"{current.round + 1}/arrived", 0)

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return self._next_rendezvous()
        except DistNetworkError as e:
            raise RendezvousConnectionError(
                f"lost the rendezvous store at {self.settings.endpoint} (the node hosting it exited or was lost): "
                f"{e}") from None

    def _next_rendezvous(self) -> RendezvousInfo:
        self._start_pulse()
        round_number = self._current.round + 1 if self._current else self._open_round()
        while True:
            index = self._arrive(round_number)
            place = self._await_membership(round_number, index)
            if place.group_rank is not None:
                return self._joined(place)
            round_number += 1
            self._emit(ev.SPARE_WAITING, round=round_number)
            logger.info("round %d is full; waiting as a spare in round %d", round_number - 1, round_number)

    # ---- rounds ------------------------------------------------------------------------
    def _open_round(self) -> int:
        """A node that was in no round yet joins the newest open round."""
        latest = self._store.add("latest", 0)
        if latest == 0:
            return 1
        target = latest + 1 if self._store.check([f"{latest}/result"]) else latest
        if target > 1 and self._store.check([f"{target - 1}/result"]):  # the job runs: wait for a slot
            self._emit(ev.SPARE_WAITING, round=target)
            logger.info("round %d is decided; waiting as a spare in round %d", target - 1, target)
        return target

    def _arrive(self, round_number: int) -> int:
        index = self._store.add(f"{round_number}/arrived", 1)
        self._store.set(f"{round_number}/node/{index}",
                        Arrival(self.node, self.settings.infra_rank).to_json())
        if index == 1:  # the round's leader, unless it is lost before deciding (see _RoundDecider)
            self._store.compare_set(f"{round_number}/leader", "", self.node)
        latest = self._store.add("latest", 0)
        while latest < round_number:  # others' next round is this one
            seen = self._store.compare_set("latest", str(latest), str(round_number)).decode()
            latest = int(seen) if seen else 0
        return index

    def _await_membership(self, round_number: int, index: int) -> Membership:
        """Wait for this arrival's own small assignment; the whole result is read only by a node
        that arrived after the decision (or whose leader died between writing the two)."""
        mine, result_key = f"{round_number}/assign/{index}", f"{round_number}/result"
        decider = RoundDecider(self, round_number, leading=index == 1)
        poll, last_slow_check = max(FIRST_POLL, index / POLL_BUDGET), -math.inf  # look at once
        slowest = max(MIN_POLL, index / POLL_BUDGET)
        slow_every = max(self.settings.heartbeat_interval, SLOW_CHECK_REQUESTS * index / POLL_BUDGET)
        while True:
            if self._store.check([mine]):
                return _parse(self._store.get(mine).decode(), Membership.from_json)
            now = self.clock()
            if now - last_slow_check > slow_every:
                last_slow_check = now
                self._check_closed()
                if self._store.check([result_key]):
                    result = _parse(self._store.get(result_key).decode(), RoundResult.from_json)
                    return membership(result, self.node)
                decider.take_over_if_leader_lost()
            if decider.leading and decider.decide_and_assign():
                continue
            time.sleep(poll)
            poll = min(poll * 1.5, slowest)

    def _check_closed(self) -> None:
        if not self._store.check(["closed"]):
            return
        if self._store.get("closed").decode() == _FINISHED:
            raise RendezvousGracefulExitError("the job finished while this node waited")
        raise RendezvousClosedError(f"rendezvous {self.settings.run_id!r} was closed")

    def _joined(self, place: Membership) -> RendezvousInfo:
        self._current = place
        rank = place.group_rank
        if place.activated:
            lost = self.last_round().lost  # the whole result: read only by a spare taking over
            self._emit(ev.SPARE_ACTIVATED, round=place.round, group_rank=rank, replaced=lost)
            logger.info("round %d: this spare takes group rank %d (replacing %s)", place.round, rank, ", ".join(lost))
        round_store = PrefixStore(f"{place.round}/store/", self._store)
        bootstrap = RendezvousStoreInfo.build(rank, round_store, self.settings.local_addr)
        logger.info("round %d: group rank %d of %d", place.round, rank, place.world_size)
        return RendezvousInfo(round_store, rank, place.world_size, bootstrap)

    def _emit(self, kind: str, **fields) -> None:
        if self.events is not None:
            self.events.emit(kind, agent=self.node, **fields)

    # ---- heartbeat and watching -------------------------------------------------------------
    def _start_pulse(self) -> None:
        if not self._registered:
            self._store.add("nodes_joined", 1)
            self._store.add(f"hb/{self.node}", 1)
            self._registered = True
            if self._heartbeat_thread:
                self._pulse = threading.Thread(target=self._pulse_loop, name="nvrx-rdzv-heartbeat", daemon=True)
                self._pulse.start()

    def _pulse_loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_interval):
            try:
                self.beat()
            except Exception as e:  # the store's host is gone: the agent's own calls will fail and say so
                logger.debug("rendezvous heartbeat failed: %s", e)

    def beat(self) -> None:
        """One heartbeat: bump this node's counter, then watch its peers (a peer whose counter
        stood still for node_timeout on `clock` is written to the round as lost). The heartbeat
        thread calls this every heartbeat_interval; with `heartbeat_thread=False` the caller does,
        from one thread at a time. Store errors are raised (the thread logs and goes on)."""
        self._store.add(f"hb/{self.node}", 1)
        self._watch(self._liveness)

    def _watch(self, liveness: Liveness) -> None:
        current = self._current
        if current is None or self._lost_in_round == current.round:
            return
        if self._store.add(f"{current.round}/lost/count", 0) > 0:
            self._lost_in_round = current.round
            return
        peers = list(current.watch)
        if not peers:
            return
        liveness.observe(dict(zip(peers, counters(self._store, peers))))
        for peer in peers:
            if liveness.lost(peer):
                logger.warning("node %s stopped its heartbeat for %.1f s: lost", peer, self.settings.node_timeout)
                self._emit(ev.NODE_LOST, round=current.round, lost_agent=peer, seen_by="watcher")
                count = self._store.add(f"{current.round}/lost/count", 1)
                self._store.set(f"{current.round}/lost/{count}", peer)
                self._lost_in_round = current.round
                return


def _parse(text: str, parse):
    """A result or membership, or the round's error raised as the exception it names."""
    if text.startswith("error:"):
        message = text[len("error:"):]
        if message.startswith("timeout:"):
            raise RendezvousTimeoutError(message[len("timeout:"):])
        raise RendezvousConflictError(message)
    return parse(text)


def create_handler(params: RendezvousParameters) -> BarrierRendezvousHandler:
    """torch's registry calls this: the real clock and the heartbeat thread."""
    settings = BarrierSettings.from_params(params)
    _, store = create_backend(params)
    return BarrierRendezvousHandler(store, settings)


def register() -> None:
    """Make `--rdzv-backend nvrx` known to torch's handler registry (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, create_handler)


def _first_line(error: Exception) -> str:
    """torch's store errors carry a C++ stack trace after their first line: noise in a log."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
