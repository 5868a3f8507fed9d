"""A coordination store that stops answering: the hung rank is still killed on time, nobody else is.

The store runs in a process of its own, so the test can SIGSTOP it: connections stay open
and requests are accepted by the kernel, but nothing answers (what a stalled agent or an
overloaded store host looks like). While it is stopped, rank 2 hangs holding the GIL:
- its monitor process must kill it within hard_timeout + 2 s, store or no store;
- the healthy ranks (blocked in the all-reduce with rank 2) must not be killed: their
  soft timeout must still fire, and what keeps their monitor processes calm must not
  depend on the store;
- once the store answers again, they restart without rank 2 and finish.
"""

import os
import signal
import time

import pytest

from test_inprocess_multirank import FAST, launch
from harness import stores, wait_for
from harness.stores import stop


@pytest.fixture
def store_process():
    with stores.store_process() as proc_port:
        yield proc_port


@pytest.mark.timeout(180)
def test_stalled_store_kills_only_the_hung_rank_and_on_time(tmp_path, store_process):
    store, port = store_process
    hard = FAST["hard_timeout"]
    marker = tmp_path / "hang_started"
    params = {"fault": "gil", "fault_rank": 2, "fault_marker": str(marker), "steps": 12,
              "config": {"heartbeat_timeout": 5.0}}  # shorter than the stall: a blind watcher must not declare anyone
    stall = {}

    def stall_the_store(procs):
        wait_for(marker.exists, timeout=90, what="rank 2 to start its hang")
        stop(store.pid)
        stall["began"] = time.monotonic()
        healthy = [procs[r] for r in (0, 1, 3)]
        # Keep it stopped until rank 2 is gone and for longer than hard_timeout: a monitor that
        # needed the store to see progress would have killed a healthy rank by then.
        try:
            wait_for(lambda: not procs[2].is_alive() and time.monotonic() - stall["began"] > hard + 1.5
                     or not all(p.is_alive() for p in healthy), timeout=hard + 30, what="the stall to end")
        except AssertionError:
            pass  # judged below, from the exit codes and events
        stall["rank2_alive_at_resume"] = procs[2].is_alive()
        os.kill(store.pid, signal.SIGCONT)
        stall["lasted"] = time.monotonic() - stall["began"]

    run = launch(tmp_path, "loop_job", params, timeout=150, store_port=port, during=stall_the_store)
    assert not stall["rank2_alive_at_resume"], f"rank 2 was not killed while the store was stalled\n{run.explain()}"
    assert run.codes == [0, 0, -signal.SIGTERM, 0], run.explain()
    killed = run.kinds("rank_killed")
    assert [(e["rank"], e["reason"]) for e in killed] == [(2, "hard_timeout")], run.explain()
    hang_began = float(marker.read_text())
    assert killed[0]["time"] - hang_began <= hard + 2.0, \
        f"killed {killed[0]['time'] - hang_began:.1f} s after the hang began\n{run.explain()}"
    assert stall["lasted"] > hard, "the store was not stalled long enough to prove anything"
    for rank, new_rank in ((0, 0), (1, 1), (3, 2)):  # restarted without rank 2, shifted down
        assert run.result(rank)["iterations"][-1] == [1, new_rank, 3], run.explain()
    soft = [e["rank"] for e in run.kinds("inprocess_interrupted") if e["cause"] == "soft_timeout" and e["by"] == "monitor"]
    assert {0, 1, 3} & set(soft), f"no soft timeout fired on a healthy rank during the stall\n{run.explain()}"
