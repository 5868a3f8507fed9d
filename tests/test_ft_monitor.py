"""The node monitor with real Unix sockets and real client objects, kills recorded not sent.

The monitor runs in a thread of the test process; `kill` is injected (as the monitor's
send_signal) so a "hung" rank here is the test process itself and must not receive SIGKILL.
Everything else is real: the socket, the JSON lines, the RankMonitorClient. Whether a timeout
fires, and what a client learns, is decided on FakeClocks the tests advance (the monitor's
deadlines, the client's intervals), never by how fast a loaded host woke a thread.
"""

import json
import os
import signal
import socket

import pytest

from nvrx_core.config import ConfigError
from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.protocol import encode
from nvrx_core.ft.timeouts import Timeouts
from harness.clock import FakeClock
from harness.node_monitor import NodeMonitorOnThread, Rank
from harness import wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def monitor(tmp_path, request):
    """Signals recorded, never sent; `clock=True` in the param gives the monitor a FakeClock."""
    cfg = dict(getattr(request, "param", {}))
    extra = {"clock": FakeClock()} if cfg.pop("clock", False) else {}
    m = NodeMonitorOnThread(tmp_path, config=FTConfig(stack_dump_grace=0.05, **cfg), record_only=True, **extra)
    m.clock = extra.get("clock")
    yield m
    m.close()


def advance_until(monitor, condition, step, what):
    """Move the fake clock by `step` until `condition()`; the monitor polls between steps."""
    def moved():
        if condition():
            return True
        monitor.clock.advance(step)
        monitor.wait_polls(1)
        return False
    wait_for(moved, what=what)


@pytest.mark.parametrize("monitor", [dict(rank_heartbeat_timeout=0.5, initial_rank_heartbeat_timeout=30,
                                          clock=True)], indirect=True)
def test_missed_heartbeat_dumps_stacks_then_kills(monitor):
    client = monitor.client()
    client.send_heartbeat()
    wait_for(lambda: monitor.monitor.cycle_stats()["heartbeats"] == 1, what="the heartbeat seen")
    monitor.clock.advance(0.49)            # just inside the timeout: nothing fires
    monitor.wait_polls()
    assert monitor.signals == []
    monitor.clock.advance(0.02)            # past it: the dump, then (after the dump wait) the kill
    advance_until(monitor, lambda: len(monitor.signals) >= 2, 0.05, "dump + kill")
    assert monitor.signals[:2] == [(os.getpid(), signal.SIGUSR2), (os.getpid(), signal.SIGKILL)]
    [detected] = monitor.events("fault_detected")
    assert detected["reason"] == "heartbeat timeout" and detected["pid"] == os.getpid()
    client.shutdown_workload_monitoring()


@pytest.mark.parametrize("monitor", [dict(rank_heartbeat_timeout=1.0, clock=True)], indirect=True)
def test_garbage_and_oversized_messages_are_dropped_and_others_still_served(monitor):
    good = monitor.client()
    vandal = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    vandal.connect(monitor.path)
    vandal.sendall(b"\x00\xff garbage\n" + b"{" * 200_000 + b"\n" + b'{"v":1,"t":"hb"}\n' +
                   encode("init", rank=9, local_rank=0, pid=1, cycle=0))  # lies about its pid
    reply = vandal.recv(65536)
    assert b'"error"' in reply
    # The good rank is still watched: heartbeats keep it alive, then silence gets it killed.
    for n in range(1, 6):                # 5 heartbeats 0.9 s apart: each one resets the 1 s timeout
        good.send_heartbeat()
        wait_for(lambda: monitor.monitor.cycle_stats()["heartbeats"] == n, what=f"heartbeat {n} seen")
        monitor.clock.advance(0.9)
        monitor.wait_polls()
    assert monitor.signals == []
    advance_until(monitor, lambda: monitor.signals, 0.05, "kill after heartbeats stop")
    assert monitor.signals[0][0] == os.getpid()
    assert monitor.monitor.cycle_stats()["heartbeats"] == 5
    vandal.close()
    good.shutdown_workload_monitoring()


@pytest.mark.parametrize("monitor", [dict(rank_section_timeouts={"step": 0.4}, rank_heartbeat_timeout=None,
                                          initial_rank_heartbeat_timeout=None, clock=True)], indirect=True)
def test_section_timeout_and_clean_bye(monitor):
    def step_open():
        watch = monitor.watch(os.getpid())
        return watch is not None and "step" in watch.open_sections

    client = monitor.client()
    for _ in range(3):                     # sections of 0.3 s (monitor time) under a 0.4 s limit
        with client.section("step"):
            wait_for(step_open, what="the section seen open")
            monitor.clock.advance(0.3)
            monitor.wait_polls()
    client.shutdown_workload_monitoring()  # bye: a rank that leaves cleanly is never killed
    wait_for(lambda: monitor.watch(os.getpid()) is None, what="the bye seen")
    monitor.clock.advance(10.0)
    monitor.wait_polls()
    assert monitor.signals == []
    client2 = monitor.client()
    client2.start_section("step")
    wait_for(step_open, what="the second client's section seen open")
    monitor.clock.advance(0.39)
    monitor.wait_polls()
    assert monitor.signals == []
    advance_until(monitor, lambda: monitor.signals, 0.05, "section timeout")
    assert monitor.events("fault_detected")[0]["reason"] == "section 'step' timeout"
    client2.shutdown_workload_monitoring()


def timed_client(monitor):
    """A connected client whose intervals are read from a FakeClock of its own: what it learns
    is decided by the intervals the test gives it, not by how long a loaded host slept."""
    clock = FakeClock()
    client = RankMonitorClient(socket_path=monitor.path, clock=clock)
    assert client.init_workload_monitoring()
    return client, clock


@pytest.mark.parametrize("monitor", [dict(rank_heartbeat_timeout=60, safety_factor=3, num_warmup_iterations=0,
                                          clock=True)], indirect=True)
def test_calculated_timeouts_reach_the_monitor_and_survive_state(monitor, tmp_path):
    client, clock = timed_client(monitor)
    client.send_heartbeat()
    for interval in (0.5, 0.8, 0.7):
        clock.advance(interval)
        client.send_heartbeat()
    assert client.calculate_and_set_timeouts()  # single process: no collective needed
    learned = client.calculated.heartbeat
    assert learned == pytest.approx(3 * 0.8)  # safety_factor x the longest interval between heartbeats
    wait_for(lambda: monitor.events("timeouts_updated"), what="timeouts pushed")
    assert monitor.events("timeouts_updated")[0]["timeouts"]["heartbeat"] == pytest.approx(learned)
    client.save_state(str(tmp_path))
    client.shutdown_workload_monitoring()
    wait_for(lambda: monitor.watch(os.getpid()) is None, what="the bye seen")

    fresh = RankMonitorClient(socket_path=monitor.path)
    assert fresh.load_state(str(tmp_path))
    assert fresh.calculated.heartbeat == pytest.approx(learned)
    assert fresh.init_workload_monitoring()  # pushes the loaded timeouts on connect
    wait_for(lambda: len(monitor.events("timeouts_updated")) == 2, what="second push")
    fresh.send_heartbeat()
    wait_for(lambda: getattr(monitor.watch(os.getpid()), "heartbeats", 0) == 1, what="the fresh client's heartbeat seen")
    monitor.clock.advance(learned - 0.01)  # within the learned timeout (the launcher's is 60 s)
    monitor.wait_polls()
    assert monitor.signals == []
    advance_until(monitor, lambda: monitor.signals, 0.05, "kill after the learned timeout")
    assert monitor.clock.now - 1000.0 < 60  # the learned timeout fired, not the configured one
    fresh.shutdown_workload_monitoring()


@pytest.mark.parametrize("monitor", [dict(rank_heartbeat_timeout=60, initial_rank_heartbeat_timeout=60,
                                          rank_section_timeouts={"setup": 60, "step": 60}, safety_factor=3,
                                          num_warmup_iterations=0)], indirect=True)
def test_excluded_timeouts_are_not_learned_and_keep_their_earlier_value(monitor):
    """A run that started from scratch must not learn how long a start takes."""
    client, clock = timed_client(monitor)
    with client.section("setup"):
        clock.advance(0.05)
    for _ in range(3):
        with client.section("step"):
            clock.advance(0.05)
        client.send_heartbeat()
    assert client.calculate_and_set_timeouts(exclude=("initial_heartbeat", "setup", "not-a-section"))
    learned = client.calculated
    assert learned.initial_heartbeat is None and learned.sections["setup"] is None
    assert learned.heartbeat is not None and learned.sections["step"] is not None
    assert client.effective_timeouts.initial_heartbeat == 60 and client.effective_timeouts.sections["setup"] == 60
    assert client.calculate_and_set_timeouts()          # nothing excluded: now learned
    assert client.calculated.initial_heartbeat is not None and client.calculated.sections["setup"] is not None
    client.shutdown_workload_monitoring()


@pytest.mark.parametrize("monitor", [dict(rank_heartbeat_timeout=None, initial_rank_heartbeat_timeout=None,
                                          rank_section_timeouts={"step": 60, "checkpointing": None},
                                          safety_factor=3, num_warmup_iterations=0)], indirect=True)
def test_learning_never_switches_on_a_timeout_the_launcher_left_unenforced(monitor):
    """A rank that sends heartbeats too (a framework callback does) under section timeouts."""
    client, clock = timed_client(monitor)
    for _ in range(3):
        with client.section("step"):
            clock.advance(0.05)
        with client.section("checkpointing"):
            pass
        client.send_heartbeat()
    assert client.calculate_and_set_timeouts()
    learned = client.calculated
    assert learned.sections["step"] is not None
    assert (learned.heartbeat, learned.initial_heartbeat, learned.sections["checkpointing"]) == (None, None, None)
    assert client.effective_timeouts.heartbeat is None
    client.shutdown_workload_monitoring()


@pytest.mark.parametrize("monitor", [dict(rank_section_timeouts={"step": 60})], indirect=True)
def test_a_section_missing_from_the_configured_ones_is_warned_about_once(monitor, caplog):
    client = monitor.client()
    with caplog.at_level("WARNING", logger="nvrx.ft.client"):
        for _ in range(3):
            with client.section("stepp"):
                pass
            with client.section("step"):
                pass
    assert caplog.text.count("section 'stepp' has no timeout") == 1 and "'step' has" not in caplog.text
    client.shutdown_workload_monitoring()


@pytest.mark.parametrize("monitor", [dict(rank_heartbeat_timeout=60)], indirect=True)
def test_under_heartbeat_timeouts_alone_sections_are_not_warned_about(monitor, caplog):
    client = monitor.client()
    with caplog.at_level("WARNING", logger="nvrx.ft.client"):
        with client.section("setup"):
            client.send_heartbeat()
    assert "has no timeout" not in caplog.text
    client.shutdown_workload_monitoring()


def test_corrupt_state_file_is_a_clear_error(tmp_path):
    (tmp_path / "ft_state.json").write_text("{not json")
    with pytest.raises(ConfigError, match="ft_state.json: not valid JSON"):
        RankMonitorClient(socket_path="unused").load_state(str(tmp_path))
    (tmp_path / "ft_state.json").write_text(json.dumps({"version": 1, "calculated_timeouts": {"heartbeat": "x"}}))
    with pytest.raises(ConfigError, match="heartbeat"):
        RankMonitorClient(socket_path="unused").load_state(str(tmp_path))
    assert not RankMonitorClient(socket_path="unused").load_state(str(tmp_path / "missing"))


def test_client_outside_ft_launcher_is_inactive_and_says_so(monkeypatch, caplog):
    monkeypatch.delenv("NVRX_FT_MONITOR_SOCKET", raising=False)
    client = RankMonitorClient()
    with caplog.at_level("WARNING", logger="nvrx.ft.client"):
        assert client.init_workload_monitoring() is False
    assert "INACTIVE" in caplog.text
    assert not client.is_active
    client.send_heartbeat()  # no-ops, no errors
    with client.section("step"):
        pass
    assert client.calculate_and_set_timeouts() is False
    assert client.calculated == Timeouts()


def test_unreachable_monitor_is_an_error(tmp_path):
    with pytest.raises(ConnectionError, match="cannot reach the ft_launcher node monitor"):
        RankMonitorClient(socket_path=str(tmp_path / "nobody.sock")).init_workload_monitoring(connect_timeout=1)



def test_stacks_of_a_hung_rank_are_reported_as_one_block_from_its_own_file(tmp_path, caplog):
    """The dump signal really reaches the rank's faulthandler; SIGKILL is only recorded. The rank
    is a process of its own (tests/scripts/ft_rank.py, idle in its command loop): faulthandler's
    dump of this test process, whose other threads run Python (the monitor's, xdist's), crashed
    it with SIGSEGV."""
    sent = []

    def send_signal(watch, sig):
        sent.append(signal.Signals(sig))
        if sig == signal.SIGUSR2:
            os.kill(watch.pid, sig)
        return True

    caplog.set_level("ERROR", logger="nvrx.ft.monitor")
    monitor = NodeMonitorOnThread(
        tmp_path, config=FTConfig(stack_dump_grace=0.05, rank_heartbeat_timeout=0.5, initial_rank_heartbeat_timeout=30),
        send_signal=send_signal)
    rank = None
    try:
        rank = Rank(monitor.path)
        stack_files = list(tmp_path.glob("stacks-rank*-pid*.txt"))
        assert [f.name for f in stack_files] == [f"stacks-rank0-pid{rank.pid}.txt"]
        rank.do("hb")
        wait_for(lambda: signal.SIGKILL in sent, what="dump + kill")
        [block] = [r.getMessage() for r in caplog.records if "stacks of hung rank 0" in r.getMessage()]
        assert "(most recent call first)" in block and "ft_rank.py" in block  # the rank, in its loop
        assert not stack_files[0].exists()  # reported, then removed
    finally:
        if rank is not None:
            rank.kill()
        monitor.close()


@pytest.mark.parametrize("monitor", [dict(rank_heartbeat_timeout=30)], indirect=True)
def test_a_rank_leaving_cleanly_leaves_no_stack_file(monitor, tmp_path):
    client = monitor.client()
    assert list(tmp_path.glob("stacks-*.txt"))
    client.shutdown_workload_monitoring()
    wait_for(lambda: not list(tmp_path.glob("stacks-*.txt")), what="stack file removed")
