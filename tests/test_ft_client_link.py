"""A rank's link to the node monitor never stalls training and survives the monitor: real
sockets, real clients (in the test process or in rank processes), real monitor processes
where the monitor dies (MonitorHandle, as ft_launcher uses it)."""

import json
import os
import signal
import threading
import time

import pytest

from harness.clock import FakeClock
from harness.node_monitor import NodeMonitorOnThread, Rank
from nvrx_core.events import read_events
from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.monitor_handle import MonitorHandle, MonitorLost
from nvrx_core.ft.watch import next_deadline
from nvrx_core.signals import STOP_REQUEST_SIGNALS
from harness import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cleanup():
    things = []
    yield things.append
    for thing in reversed(things):
        if isinstance(thing, Rank):
            thing.kill()
        elif isinstance(thing, MonitorHandle):
            thing.stop()
        else:
            thing.close()


def test_calls_never_wait_for_a_stopped_monitor_which_then_gets_the_rank_s_whole_state(tmp_path, cleanup):
    config = FTConfig(rank_heartbeat_timeout=60, rank_section_timeouts={"step": 60})
    # The rank's and the monitor's clock: a FakeClock, so where the monitor puts the open
    # section's start (from the age the state carried) is judged exactly, not against the
    # delivery delay a loaded node adds.
    clock = FakeClock()
    monitor = NodeMonitorOnThread(tmp_path, config=config, send_signal=lambda watch, sig: True,  # the rank is this process
                                  clock=clock)
    cleanup(monitor)
    client = RankMonitorClient(socket_path=monitor.path, clock=clock)
    assert client.init_workload_monitoring()
    cleanup(type("Shutdown", (), {"close": lambda self: client.shutdown_workload_monitoring()})())
    wait_for(lambda: monitor.watch(os.getpid()) is not None, what="registered")
    monitor.pause()  # like SIGSTOP: nothing is read from the socket any more
    calls = 5000

    def train():
        for step in range(calls):
            client.send_heartbeat()
            client.start_section("step")
            client.end_section("step")
            client.report_progress(step)
        client.start_section("step")  # left open: the monitor must learn that too

    trainer = threading.Thread(target=train)
    start = time.monotonic()
    trainer.start()
    trainer.join(60)
    took = time.monotonic() - start
    assert not trainer.is_alive(), "a hot-path call blocked on the stopped monitor"
    assert took < 30, took  # 20000 calls, whatever the socket buffer holds (about 300 messages); bounds a hang
    opened = clock.now
    clock.advance(7.0)  # the monitor stays stopped for 7 s
    monitor.resume()
    watch = monitor.watch(os.getpid())
    wait_for(lambda: watch.heartbeats == calls and watch.section_ends == calls, what="the whole state")
    assert watch.max_iteration == calls - 1
    # Its start is derived from the age the state carried (7 s), not from when it arrived.
    assert list(watch.open_sections) == ["step"] and watch.open_sections["step"] == pytest.approx(opened)
    assert monitor.monitor.cycle_stats()["heartbeats"] == calls


def test_a_rank_re_registers_with_a_restarted_monitor_under_the_same_deadlines(tmp_path, cleanup):
    config = FTConfig(rank_heartbeat_timeout=300, initial_rank_heartbeat_timeout=600,
                      rank_section_timeouts={"step": 200})
    state_dir = tmp_path / "ckpt"
    state_dir.mkdir()
    (state_dir / "ft_state.json").write_text(json.dumps({"version": 1, "calculated_timeouts": {"heartbeat": 120}}))
    first = NodeMonitorOnThread(tmp_path, config=config)
    cleanup(first)
    rank = Rank(first.path)
    cleanup(rank)
    rank.do(f"load {state_dir}", "hb", "progress 7", "ss step")
    wait_for(lambda: first.watch(rank.pid) is not None and first.watch(rank.pid).open_sections, what="state")
    before = first.watch(rank.pid)
    first.close()  # its connections end, as when the process dies
    second = NodeMonitorOnThread(tmp_path, listener=first.listener, config=config)
    cleanup(second)
    wait_for(lambda: getattr(second.watch(rank.pid), "heartbeats", 0) == 1, timeout=30, what="re-registration")
    after = second.watch(rank.pid)
    assert after.timeouts.heartbeat == 120  # the calculated timeout, not the configured 300
    assert after.max_iteration == 7 and list(after.open_sections) == ["step"]
    for field in ("last_heartbeat", "connected_at"):
        assert abs(getattr(after, field) - getattr(before, field)) < 1.0, field
    assert abs(after.open_sections["step"] - before.open_sections["step"]) < 1.0
    assert abs(next_deadline(after)[0] - next_deadline(before)[0]) < 1.0  # same deadline, not a fresh one
    assert next_deadline(after)[1] == "heartbeat timeout"


def test_a_killed_monitor_is_restarted_and_the_idle_rank_is_still_caught(tmp_path, cleanup):
    events_file = str(tmp_path / "events.jsonl")
    handle = MonitorHandle(FTConfig(rank_heartbeat_timeout=2, initial_rank_heartbeat_timeout=60), events_file)
    cleanup(handle)
    handle.new_cycle(3)
    rank = Rank(handle.socket_path)
    cleanup(rank)
    handle.workers_started({0: rank.pid})
    rank.do("hb")
    heartbeat_at = time.time()
    old = handle.process.pid
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: handle.process.poll() is not None, what="the monitor dead")
    assert handle.ensure_running() and handle.process.pid != old
    assert handle.cycle_stats()["cycle"] == 3  # the restart cycle goes to the new monitor
    assert rank.proc.wait(timeout=60) == -signal.SIGKILL  # re-registered; then its silence is a hang
    events = read_events(events_file)
    [restarted] = [e for e in events if e["kind"] == "monitor_restarted"]
    assert restarted["old_pid"] == old and restarted["new_pid"] == handle.process.pid and restarted["cycle"] == 3
    [detected] = [e for e in events if e["kind"] == "fault_detected"]
    assert detected["reason"] == "heartbeat timeout" and detected["pid"] == rank.pid
    assert detected["time"] - heartbeat_at < 2 + 15  # the 2 s from its last heartbeat, kept across the restart


def test_a_monitor_that_keeps_dying_is_given_up(tmp_path, cleanup):
    handle = MonitorHandle(FTConfig(), None, restart_limit=2, restart_window=600)
    cleanup(handle)
    for _ in range(2):
        handle.process.kill()
        handle.process.wait()
        assert handle.ensure_running()
    handle.process.kill()
    handle.process.wait()
    with pytest.raises(MonitorLost, match="died 3 times"):
        handle.ensure_running()


def test_the_monitor_outlives_a_stop_signal_to_the_whole_job_and_ends_when_the_launcher_asks(tmp_path, cleanup):
    """Slurm's --signal reaches every process of the job step, the monitor included: it keeps
    watching the ranks while they save (their timeouts still hold), not restarted, and ends on
    the launcher's request (MonitorHandle.stop), not by being killed."""
    handle = MonitorHandle(FTConfig(rank_heartbeat_timeout=2, initial_rank_heartbeat_timeout=60), None)
    cleanup(handle)
    pid = handle.process.pid
    handle.cycle_stats()  # serving: its dispositions are set
    rank = Rank(handle.socket_path)
    cleanup(rank)
    handle.workers_started({0: rank.pid})
    rank.do("hb")
    for sig in STOP_REQUEST_SIGNALS:
        os.kill(pid, sig)
    # the signals were delivered before it could read the request: had one ended it, this
    # request would have been answered by a restarted monitor
    assert handle.cycle_stats()["cycle"] == 0
    assert handle.process.pid == pid and handle.process.poll() is None
    assert rank.proc.wait(timeout=60) == -signal.SIGKILL  # still enforcing: the silent rank is a hang
    handle.stop()
    assert handle.process.returncode == 0  # it took the stop request; SIGKILL is only the fallback


def test_shutdown_gives_the_stack_dump_signal_back(tmp_path, cleanup):
    """Undo what you install: after shutdown another part of the job may claim the signal
    (preemption on SIGUSR2 in the same process used to be refused: the client kept it)."""
    from nvrx_core.signals import default_registry

    monitor = NodeMonitorOnThread(tmp_path)
    cleanup(monitor)
    client = RankMonitorClient(socket_path=monitor.path)
    registry = default_registry()
    assert registry.is_free(signal.SIGUSR2)
    client.init_workload_monitoring()
    assert "ft.client" in registry.owners().get("SIGUSR2", [])
    client.shutdown_workload_monitoring()
    assert registry.is_free(signal.SIGUSR2)
    registry.claim(signal.SIGUSR2, "preemption", lambda *_: None).release()
