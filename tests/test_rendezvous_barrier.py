"""The barrier rendezvous handler on a real TCPStore, each node a handler driven by a thread.

The agents' process side (workers stopping, restarting) is covered by tests/test_multinode.py;
here the handler's own protocol: rounds, spares, loss detection, errors, closing.

Every verdict about time is made on one shared FakeClock (docs/test_timing.md): the handlers run
no heartbeat thread; a ticker thread beats every node not lost, then moves the clock half a
heartbeat. So a live node never goes node_timeout of fake time without a beat, however late the
host runs the ticker, and a lost node is found once node_timeout of fake time has passed.
Seconds in the settings (join_timeout, last call) are fake seconds.
"""

import concurrent.futures as cf
import contextlib
import datetime
import threading

import pytest
from torch.distributed import DistNetworkError, HashStore, TCPStore
from torch.distributed.elastic.rendezvous import (RendezvousGracefulExitError, RendezvousParameters,
                                                  RendezvousTimeoutError)

from harness import wait_for
from harness.clock import FakeClock
from nvrx_core.config import ConfigError
from nvrx_core.ft.rendezvous import BarrierRendezvousHandler, BarrierSettings, create_handler
from nvrx_core.ft.rendezvous_leader import Liveness, RoundDecider
from nvrx_core.ft.rendezvous_round import RendezvousConflictError, RoundResult

FAST = dict(heartbeat_interval=0.1, node_timeout=0.6, last_call_timeout=0.5)
TICK = 0.005  # real seconds between the ticker's steps: fake time runs at most ~10x real time


class Ticker:
    """Each step: one beat() of every node not lost, then the clock moves half a heartbeat."""

    def __init__(self, clock: FakeClock, step: float):
        self.clock, self.step = clock, step
        self.nodes = []
        self.errors = []
        self._lock = threading.Lock()  # a step is whole: lose() returns only between steps
        self._held = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-heartbeats", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(TICK):
            with self._lock:
                for node in self.nodes:
                    try:
                        node.beat()
                    except Exception as e:  # reported at the test's end
                        self.errors.append(f"{node.node}: {e!r}")
                if not self._held:
                    self.clock.advance(self.step)

    def add(self, node):
        with self._lock:
            self.nodes.append(node)

    def lose(self, node):
        with self._lock:
            self.nodes.remove(node)

    @contextlib.contextmanager
    def clock_held(self):
        """Nodes keep beating, the clock stands still: a setup that must not race a timeout."""
        with self._lock:
            self._held = True
        try:
            yield
        finally:
            with self._lock:
                self._held = False

    def close(self):
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def ticker(clock):
    t = Ticker(clock, FAST["heartbeat_interval"] / 2)
    yield t
    t.close()
    assert not t.errors, t.errors


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    yield server


@pytest.fixture
def pool(ticker):  # torn down before the ticker: a rendezvous still waiting sees the close below
    with cf.ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


@pytest.fixture
def make_node(store, clock, ticker, pool):
    made = []

    def make(min_nodes=2, max_nodes=2, node_clock=None, heartbeat_thread=False, **kw):
        """A node on the shared fake clock beaten by the ticker (or, heartbeat_thread=True, on
        `node_clock` beaten by its own thread)."""
        client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
        handler = BarrierRendezvousHandler(client, BarrierSettings("job", min_nodes, max_nodes, **{**FAST, **kw}),
                                           clock=node_clock or clock, heartbeat_thread=heartbeat_thread)
        made.append(handler)
        if not heartbeat_thread:
            ticker.add(handler)
        return handler

    yield make
    if made:
        made[0].set_closed()  # a node still waiting (a failed test) raises instead of holding the pool
    for handler in made:
        handler.stop_heartbeat()


def join(pool, *nodes):
    return [pool.submit(n.next_rendezvous) for n in nodes]


def ranks(futures, timeout=30):
    return [(f.result(timeout).rank, f.result(timeout).world_size) for f in futures]


@pytest.fixture
def lose(ticker):
    def lose(node):
        """What a SIGKILLed or stopped agent looks like to the others: its heartbeat stops."""
        ticker.lose(node)
    return lose


def fake_time_passes(clock, seconds):
    """An observation window before asserting that something did not happen: `seconds` of the
    nodes' clock (a late host only makes the check weaker, never fail)."""
    start = clock.now
    wait_for(lambda: clock.now > start + seconds, 30, f"{seconds} s of fake time")


def test_two_nodes_and_a_spare_then_a_lost_node_is_replaced_by_the_spare(pool, make_node, lose, clock):
    a = make_node()
    a_first = join(pool, a)
    wait_for(lambda: a._store.add("1/arrived", 0) == 1, 30, "a first in round 1")
    b = make_node()
    first = join(pool, b)
    assert ranks(a_first + first) == [(0, 2), (1, 2)]
    spare = make_node()
    waiting = pool.submit(spare.next_rendezvous)
    wait_for(lambda: a._store.add("2/arrived", 0) == 1, 30, "the spare in round 2")
    fake_time_passes(clock, 1.5)  # past node_timeout and last call
    assert not waiting.done() and a.num_nodes_waiting() == 0  # a full world does not restart for a spare

    lose(b)
    wait_for(lambda: a.num_nodes_waiting() > 0, 30, "b found lost")  # a watched b and found it lost
    again = pool.submit(a.next_rendezvous)
    assert ranks([again, waiting]) == [(0, 2), (1, 2)]  # the spare holds b's group rank, a kept its own
    assert a.last_round().lost == [b.node] and a.last_round().activated == [spare.node]


def test_a_restart_without_loss_keeps_the_ranks_and_the_spare_waiting(pool, make_node, clock):
    a, b, spare = make_node(), make_node(), make_node()
    ranks(join(pool, a, b))
    first_slots = dict(a.last_round().slots)
    waiting = pool.submit(spare.next_rendezvous)
    wait_for(lambda: a._store.add("2/arrived", 0) == 1, 30, "the spare in round 2")
    fake_time_passes(clock, 1.5)  # the spare leads round 2: it waits for a and b, alive
    ranks(join(pool, b, a))
    assert a.last_round().round == 2 and a.last_round().slots == first_slots and not waiting.done()
    a.finish()
    with pytest.raises(RendezvousGracefulExitError):
        waiting.result(10)


def test_without_a_spare_the_survivor_waits_for_a_replacement_node(pool, make_node, lose, clock):
    a, b = make_node(), make_node()
    ranks(join(pool, a, b))
    rank_b = b.last_round().group_rank(b.node)
    lose(b)
    wait_for(lambda: a.num_nodes_waiting() > 0, 30, "b found lost")
    survivor = pool.submit(a.next_rendezvous)
    wait_for(lambda: a._store.add("2/arrived", 0) == 1, 30, "a in round 2")
    fake_time_passes(clock, 1.5)  # past node_timeout and last call: still no round without a second node
    assert not survivor.done()
    replacement = make_node()
    late = pool.submit(replacement.next_rendezvous)
    assert late.result(30).rank == rank_b and survivor.result(30).world_size == 2


def test_infra_ranks_are_kept_and_a_spare_inherits_the_lost_nodes(pool, make_node, lose):
    n1, n0, spare = make_node(infra_rank=1), make_node(infra_rank=0), make_node(infra_rank=2)
    assert ranks(join(pool, n1, n0)) == [(1, 2), (0, 2)]
    waiting = pool.submit(spare.next_rendezvous)
    lose(n0)
    wait_for(lambda: n1.num_nodes_waiting() > 0, 30, "n0 found lost")
    assert ranks([pool.submit(n1.next_rendezvous), waiting]) == [(1, 2), (0, 2)]


def test_two_nodes_claiming_one_infra_rank_fail_naming_both(pool, make_node):
    x, y = make_node(infra_rank=0), make_node(infra_rank=0)
    futures = join(pool, x, y)
    for f in futures:
        with pytest.raises(RendezvousConflictError, match="both claim infra group rank 0") as caught:
            f.result(30)
        assert x.node in str(caught.value) and y.node in str(caught.value)


def test_a_spare_with_an_active_nodes_infra_rank_fails_and_the_job_goes_on(pool, make_node):
    n0, n1 = make_node(infra_rank=0), make_node(infra_rank=1)
    ranks(join(pool, n0, n1))
    clash = make_node(infra_rank=1)
    with pytest.raises(RendezvousConflictError, match=f"nodes {n1.node} and {clash.node} both claim"):
        clash.next_rendezvous()
    assert n0.num_nodes_waiting() == 0


def test_too_few_nodes_fail_after_join_timeout(make_node):
    lonely = make_node(join_timeout=0.5)
    with pytest.raises(RendezvousTimeoutError, match="1 node\\(s\\) arrived, 2 needed"):
        lonely.next_rendezvous()


def test_a_new_leader_decides_when_the_first_arrival_is_lost(pool, make_node, lose, ticker):
    silent = make_node()
    lose(silent)
    silent._store.add("1/arrived", 1)  # arrived first, then died before deciding anything
    silent._store.set("1/leader", silent.node)
    silent._store.add(f"hb/{silent.node}", 1)
    silent._store.set("1/node/1", '{"node": "%s", "infra_rank": null}' % silent.node)
    a, b = make_node(min_nodes=1, max_nodes=2), make_node(min_nodes=1, max_nodes=2)
    with ticker.clock_held():  # both arrive before the take-over (past last call, one would close the round)
        futures = join(pool, a, b)
        wait_for(lambda: a._store.add("1/arrived", 0) == 3, 30, "a and b in round 1")
    assert sorted(ranks(futures)) == [(0, 2), (1, 2)]
    assert silent.node not in a.last_round().nodes()


def test_liveness_needs_a_still_counter_for_the_whole_timeout():
    now = [0.0]
    liveness = Liveness(2.0, clock=lambda: now[0])
    liveness.observe({"n": 1})
    now[0] = 1.5
    liveness.observe({"n": 2})
    now[0] = 3.0
    assert not liveness.lost("n") and not liveness.lost("never-seen")
    now[0] = 3.6
    assert liveness.lost("n")


def fake_round(min_nodes, max_nodes, arrivals):
    """Handlers on one in-memory store and one FakeClock, no threads: `arrivals` nodes arrived in
    round 1 (the first is its leader) and each beat once."""
    clock, store = FakeClock(), HashStore()
    nodes = [BarrierRendezvousHandler(store, BarrierSettings("job", min_nodes, max_nodes, **FAST), clock=clock,
                                      heartbeat_thread=False) for _ in range(arrivals)]
    for node in nodes:
        node._arrive(1)
        node.beat()
    return clock, nodes


def test_a_waiting_node_takes_over_only_after_the_leaders_heartbeat_stood_still_for_node_timeout():
    clock, (leader, waiting) = fake_round(2, 2, 2)
    decider = RoundDecider(waiting, 1, leading=False)
    for _ in range(20):  # 2 s, the leader beating every half heartbeat: alive
        decider.take_over_if_leader_lost()
        leader.beat()
        clock.advance(0.05)
    decider.take_over_if_leader_lost()
    assert not decider.leading
    clock.advance(0.59)  # silent for just under node_timeout (0.6): not yet
    decider.take_over_if_leader_lost()
    assert not decider.leading
    clock.advance(0.02)
    decider.take_over_if_leader_lost()
    assert decider.leading and waiting._store.get("1/leader").decode() == waiting.node
    assert RoundDecider(leader, 1, leading=False).leading is False  # the old leader, back, does not lead


def test_a_short_round_fails_after_join_timeout_and_a_round_past_last_call_closes_on_the_clock():
    clock, (lonely,) = fake_round(2, 2, 1)
    decider = RoundDecider(lonely, 1, leading=True)
    assert decider.decide() is None  # short of nodes since now
    clock.advance(599.99)  # just under join_timeout (600)
    assert decider.decide() is None
    clock.advance(0.02)
    assert decider.decide().startswith("error:timeout:round 1: 1 node(s) arrived, 2 needed")

    clock, (first,) = fake_round(1, 2, 1)
    decider = RoundDecider(first, 1, leading=True)
    clock.advance(0.49)  # just under last_call_timeout (0.5): a second node may still come
    assert decider.decide() is None
    clock.advance(0.02)
    assert RoundResult.from_json(decider.decide()).slots == {0: first.node}


@pytest.mark.parametrize("conf, expected", [
    ({"node_timeout": "0.1", "heartbeat_interval": "1"}, "node_timeout"),
    ({"join_timeout": "soon"}, "join_timeout"),
])
def test_bad_rendezvous_options_are_config_errors(conf, expected):
    params = RendezvousParameters("nvrx", "127.0.0.1:0", "job", 1, 1, **conf)
    with pytest.raises(ConfigError, match=expected):
        create_handler(params)


def test_a_node_that_finishes_after_the_store_host_left_ends_cleanly(pool, caplog):
    # the store lives in another process, which exits first (its agent finished a little earlier)
    import subprocess
    import sys

    host = subprocess.Popen([sys.executable, "-c", (
        "import sys, datetime\n"
        "from torch.distributed import TCPStore\n"
        "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
        "print(s.port, flush=True)\n"
        "sys.stdin.readline()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        nodes = [BarrierRendezvousHandler(TCPStore("127.0.0.1", port, is_master=False,
                                                   timeout=datetime.timedelta(seconds=5)),
                                          BarrierSettings("job", 2, 2, **FAST), clock=FakeClock(),
                                          heartbeat_thread=False) for _ in range(2)]
        assert sorted(ranks(join(pool, *nodes))) == [(0, 2), (1, 2)]
        host.stdin.close()
        host.wait(timeout=30)
        with pytest.raises(DistNetworkError):  # the heartbeat that the node's thread would make meanwhile
            nodes[1].beat()                     # (a first set() to a closed peer can still "succeed")
        with caplog.at_level("INFO", logger="nvrx.ft.rendezvous"):
            nodes[1].finish()                       # no exception: the training is done
            assert nodes[1].shutdown() is True
        lines = [r.getMessage() for r in caplog.records if "store's host already left" in r.getMessage()]
        assert len(lines) == 2 and all("\n" not in line and "frame #" not in line for line in lines), lines
    finally:
        host.kill()
        host.wait()
        for node in locals().get("nodes", []):
            node.stop_heartbeat()


def test_the_heartbeat_thread_is_stopped_and_joined_where_the_rendezvous_stays_open(pool, make_node):
    # after a stop signal the launcher leaves the rendezvous open for other nodes, but its heartbeat
    # thread must not outlive it: a daemon thread inside a store call at interpreter exit aborts it
    still = FakeClock()  # beaten by their threads on real time; nobody found lost on a clock standing still
    nodes = [make_node(node_clock=still, heartbeat_thread=True), make_node(node_clock=still, heartbeat_thread=True)]
    assert sorted(ranks(join(pool, *nodes))) == [(0, 2), (1, 2)]
    assert nodes[0]._pulse.is_alive()
    nodes[0].stop_heartbeat()
    assert not nodes[0]._pulse.is_alive() and not nodes[0].is_closed()
