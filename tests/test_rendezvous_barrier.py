"""The barrier rendezvous handler on a real TCPStore, each node a handler driven by a thread.

The agents' process side (workers stopping, restarting) is covered by tests/test_multinode.py;
here the handler's own protocol: rounds, spares, loss detection, errors, closing.
"""

import concurrent.futures as cf
import datetime
import time

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (RendezvousGracefulExitError, RendezvousParameters,
                                                  RendezvousTimeoutError)

from nvrx_core.config import ConfigError
from nvrx_core.demo.nodes import wait_for
from nvrx_core.ft.rendezvous import BarrierRendezvousHandler, BarrierSettings, create_handler
from nvrx_core.ft.rendezvous_leader import Liveness
from nvrx_core.ft.rendezvous_round import RendezvousConflictError

FAST = dict(heartbeat_interval=0.1, node_timeout=0.6, last_call_timeout=0.5)


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    yield server


@pytest.fixture
def pool():
    with cf.ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


@pytest.fixture
def make_node(store):
    made = []

    def make(min_nodes=2, max_nodes=2, **kw):
        client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
        handler = BarrierRendezvousHandler(client, BarrierSettings("job", min_nodes, max_nodes, **{**FAST, **kw}))
        made.append(handler)
        return handler

    yield make
    for handler in made:
        handler._stop.set()


def join(pool, *nodes):
    return [pool.submit(n.next_rendezvous) for n in nodes]


def ranks(futures, timeout=30):
    return [(f.result(timeout).rank, f.result(timeout).world_size) for f in futures]


def lose(node):
    """What a SIGKILLed or stopped agent looks like to the others: its heartbeat stops."""
    node._stop.set()


def test_two_nodes_and_a_spare_then_a_lost_node_is_replaced_by_the_spare(pool, make_node):
    a = make_node()
    a_first = join(pool, a)
    wait_for(lambda: a._store.add("1/arrived", 0) == 1, 30, "a first in round 1")
    b = make_node()
    first = join(pool, b)
    assert ranks(a_first + first) == [(0, 2), (1, 2)]
    spare = make_node()
    waiting = pool.submit(spare.next_rendezvous)
    time.sleep(0.3)
    assert not waiting.done() and a.num_nodes_waiting() == 0  # a full world does not restart for a spare

    lose(b)
    wait_for(lambda: a.num_nodes_waiting() > 0, 30, "b found lost")  # a watched b and found it lost
    again = pool.submit(a.next_rendezvous)
    assert ranks([again, waiting]) == [(0, 2), (1, 2)]  # the spare holds b's group rank, a kept its own
    assert a.last_round().lost == [b.node] and a.last_round().activated == [spare.node]


def test_a_restart_without_loss_keeps_the_ranks_and_the_spare_waiting(pool, make_node):
    a, b, spare = make_node(), make_node(), make_node()
    ranks(join(pool, a, b))
    first_slots = dict(a.last_round().slots)
    waiting = pool.submit(spare.next_rendezvous)
    time.sleep(0.3)
    ranks(join(pool, b, a))
    assert a.last_round().round == 2 and a.last_round().slots == first_slots and not waiting.done()
    a.finish()
    with pytest.raises(RendezvousGracefulExitError):
        waiting.result(10)


def test_without_a_spare_the_survivor_waits_for_a_replacement_node(pool, make_node):
    a, b = make_node(), make_node()
    ranks(join(pool, a, b))
    rank_b = b.last_round().group_rank(b.node)
    lose(b)
    wait_for(lambda: a.num_nodes_waiting() > 0, 30, "b found lost")
    survivor = pool.submit(a.next_rendezvous)
    time.sleep(1.5)  # past node_timeout and last call: still no round without a second node
    assert not survivor.done()
    replacement = make_node()
    late = pool.submit(replacement.next_rendezvous)
    assert late.result(30).rank == rank_b and survivor.result(30).world_size == 2


def test_infra_ranks_are_kept_and_a_spare_inherits_the_lost_nodes(pool, make_node):
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


def test_a_new_leader_decides_when_the_first_arrival_is_lost(pool, make_node, store):
    silent = make_node()
    silent._store.add("1/arrived", 1)  # arrived first, then died before deciding anything
    silent._store.set("1/leader", silent.node)
    silent._store.add(f"hb/{silent.node}", 1)
    silent._store.set("1/node/1", '{"node": "%s", "infra_rank": null}' % silent.node)
    a, b = make_node(min_nodes=1, max_nodes=2), make_node(min_nodes=1, max_nodes=2)
    assert sorted(ranks(join(pool, a, b))) == [(0, 2), (1, 2)]
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
                                          BarrierSettings("job", 2, 2, **FAST)) for _ in range(2)]
        assert sorted(ranks(join(pool, *nodes))) == [(0, 2), (1, 2)]
        host.stdin.close()
        host.wait(timeout=30)
        with caplog.at_level("INFO", logger="nvrx.ft.rendezvous"):
            nodes[1].finish()                       # no exception: the training is done
            assert nodes[1].shutdown() is True
        lines = [r.getMessage() for r in caplog.records if "store's host already left" in r.getMessage()]
        assert len(lines) == 2 and all("\n" not in line and "frame #" not in line for line in lines), lines
    finally:
        host.kill()
        host.wait()
        for node in locals().get("nodes", []):
            node._stop.set()


def test_the_heartbeat_thread_is_stopped_and_joined_where_the_rendezvous_stays_open(pool, make_node):
    # after a stop signal the launcher leaves the rendezvous open for other nodes, but its heartbeat
    # thread must not outlive it: a daemon thread inside a store call at interpreter exit aborts it
    nodes = [make_node(), make_node()]
    assert sorted(ranks(join(pool, *nodes))) == [(0, 2), (1, 2)]
    assert nodes[0]._pulse.is_alive()
    nodes[0].stop_heartbeat()
    assert not nodes[0]._pulse.is_alive() and not nodes[0].is_closed()
