"""The watchdogs' parts, one at a time: bounded store requests, blind heartbeat watchers,
progress reported to the hard-timeout monitor, interruptions outside the function, and
the store's verdict on how an iteration ended.
"""

import faulthandler
import os
import signal
import sys
import time
import types

import pytest
import torch.distributed as dist

import warm_python
from nvrx_core.events import EVENTS_FILE_ENV, RANK_KILLED, EventLog, read_events
from nvrx_core.inprocess import InProcessConfig
from nvrx_core.inprocess.abort import AbortProcessGroups, IterationConnections
from nvrx_core.inprocess.coordination import COMPLETED, RESTART, Coordinator, HeartbeatWatch
from nvrx_core.inprocess.errors import RestartRequested
from nvrx_core.inprocess.interruption import MainThreadInterrupter, MainThreadProgress
from nvrx_core.inprocess.monitor_process import MonitorProcess, MonitorSettings, ProgressReporter
from nvrx_core.inprocess.monitor_thread import MonitorThread
from nvrx_core.inprocess.records import Cause
from nvrx_core.proc import process_state
from nvrx_core.inprocess.store import BoundedStore, StoreUnavailable
from harness import stores, wait_for
from harness.clock import FakeClock
from harness.stores import host_store, stop


@pytest.fixture
def store_process():
    with stores.store_process() as proc_port:
        yield proc_port


@pytest.mark.timeout(60)
def test_bounded_store_fails_fast_while_the_store_is_stopped_and_stays_in_step_after(store_process):
    proc, port = store_process
    store = BoundedStore(lambda: dist.TCPStore("127.0.0.1", port, is_master=False), timeout=0.5, name="test")
    try:
        assert store.add("n", 1) == 1
        stop(proc.pid)
        began = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no answer within 0.5 s"):
            store.add("n", 1)  # a TCPStore client alone would wait for ever
        assert time.monotonic() - began < 3  # the 0.5 s timeout, not for ever (bounds a hang only)
        with pytest.raises(StoreUnavailable, match="has not answered add"):
            store.check(["n"])  # refused at once: no second request piles up behind the first
        assert store.stalls == 1  # (a request sent and timed out would be a second stall)
        os.kill(proc.pid, signal.SIGCONT)

        def answered():
            try:
                return store.add("n", 0)
            except StoreUnavailable:
                return None

        wait_for(lambda: answered() is not None, timeout=20, what="the store to answer again")
        assert store.add("n", 0) == 2  # the late add was applied once, and its answer not taken for another's
        assert store.stalls == 1
    finally:
        store.close()


def test_heartbeat_silence_counts_only_while_the_watcher_could_read():
    now = [0.0]
    watch = HeartbeatWatch(clock=lambda: now[0], blind_after=1.0)
    watch.update({1: b"5", 2: b"9"})
    now[0] = 0.5
    watch.update({1: b"6", 2: b"9"})
    now[0] = 8.0  # no read for 7.5 s (the store stalled): nobody's silence is known
    watch.update({1: b"6", 2: b"9"})
    assert watch.stale(2.0) == []
    for beat in range(5):  # reading again every 0.5 s: rank 1 beats, rank 2 stays silent
        now[0] += 0.5
        watch.update({1: str(beat).encode(), 2: b"9"})
    assert watch.stale(2.0) == [2]  # silent for 2.5 s of reading


def test_the_soft_timeout_fires_past_soft_timeout_of_the_monitors_clock():
    """The monitor thread decides on the clock it is given: a main thread idle for exactly
    soft_timeout is not hung, a moment more is (interrupted, recorded in the store); outside
    the wrapped function nothing fires."""
    server = host_store()
    coord = Coordinator(dist.TCPStore("127.0.0.1", server.port, is_master=False), "soft", 0)
    clock, requests = FakeClock(), []
    monitor = MonitorThread(coord, InProcessConfig(soft_timeout=2.0, hard_timeout=5.0, barrier_timeout=60.0),
                            interrupter=types.SimpleNamespace(request=requests.append, armed=True),
                            progress=MainThreadProgress(clock=clock),
                            abort=types.SimpleNamespace(abort_communication=lambda: 0),
                            events=EventLog(None, source="test"), clock=clock)
    monitor.begin_iteration(0, [0], terminated_base=coord.terminated_count())
    clock.advance(5.0)
    monitor._check_soft_timeout(clock())  # not in the function (the Wrapper's own code): never
    assert monitor.triggered is None
    monitor.enter_function()  # counts as progress
    clock.advance(2.0)
    monitor._check_soft_timeout(clock())
    assert monitor.triggered is None and requests == []
    clock.advance(0.01)
    monitor._check_soft_timeout(clock())
    assert monitor.triggered == Cause.SOFT_TIMEOUT and "ran no Python for 2.0 s" in requests[0], requests
    assert [r.cause for r in coord.records(0)] == [Cause.SOFT_TIMEOUT]


def test_progress_reported_to_the_monitor_process():
    now = [100.0]
    progress = MainThreadProgress(clock=lambda: now[0])
    in_function = [True]
    reporter = ProgressReporter(progress, monitor_process=None, in_function=lambda: in_function[0], interval=0.1,
                                machinery_allowance=30.0, clock=lambda: now[0])
    now[0] = 110.0
    assert reporter.reported(now[0]) == 100.0  # the function runs: only the main thread's bytecode counts
    in_function[0] = False  # the Wrapper's own code, e.g. a store request the store does not answer
    assert reporter.reported(now[0]) == 110.0
    now[0] = 150.0
    assert reporter.reported(now[0]) == 130.0  # vouched for up to barrier_timeout, not for ever


def test_a_request_taken_in_the_wrappers_own_frames_is_not_raised():
    interrupter = MainThreadInterrupter(signal.SIGUSR1)
    interrupter.arm()
    try:
        for own in (MainThreadInterrupter.call, MainThreadInterrupter.disarm):
            interrupter._handle(signal.SIGUSR1, types.SimpleNamespace(f_code=own.__code__))
        assert interrupter.late_requests == 2
        with pytest.raises(RestartRequested):  # inside the function it is raised
            interrupter._handle(signal.SIGUSR1, sys._getframe())
    finally:
        interrupter.disarm()


def test_the_first_verdict_on_an_iteration_is_everyones(tmp_path):
    server = host_store()
    a, b = (Coordinator(dist.TCPStore("127.0.0.1", server.port, is_master=False), "v", r) for r in range(2))
    assert a.settle(3, RESTART) == RESTART
    assert b.settle(3, COMPLETED) == RESTART
    assert b.settle(4, COMPLETED) == COMPLETED and a.settle(4, RESTART) == COMPLETED


def test_destroy_resets_the_group_counter_a_failed_creation_left_ahead():
    """Ranks whose init_process_group failed would otherwise name the next group differently."""
    world = dist.distributed_c10d._world
    world.group_count = 3
    AbortProcessGroups(IterationConnections(), empty_cuda_cache=False).destroy()
    assert world.group_count == 0


HANDLED_BY_EXIT = 43
"""The exit status of a rank whose SIGTERM handler ran (a SIGKILLed one ends -9)."""


def _rank_that_stops(events_file, monitor_pid_file):
    """A rank whose hard-timeout monitor runs, with a SIGTERM handler, that stops (SIGSTOP) at once.
    Its monitor is stopped too, right after its start, until the test has seen the rank stopped
    and continues it (writes its pid to `monitor_pid_file` for that)."""
    os.environ[EVENTS_FILE_ENV] = events_file
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # as the Wrapper arms the stack dump
    signal.signal(signal.SIGTERM, lambda *a: os._exit(HANDLED_BY_EXIT))
    monitor = MonitorProcess(MonitorSettings(rank=0, hard_timeout=2.0, termination_grace=600.0,
                                             termination_signal=signal.SIGTERM, interval=0.05,
                                             stack_dump_signal=signal.SIGUSR2),
                             declare_terminated=lambda cause, detail: None)
    monitor.start()
    os.kill(monitor.pid, signal.SIGSTOP)
    with open(monitor_pid_file + ".tmp", "w") as f:
        f.write(str(monitor.pid))
    os.replace(monitor_pid_file + ".tmp", monitor_pid_file)
    os.kill(os.getpid(), signal.SIGSTOP)  # no progress reaches the monitor from here on
    time.sleep(600)


@pytest.mark.timeout(180)
def test_the_hard_timeout_kill_continues_a_stopped_rank_so_its_termination_handler_runs(tmp_path):
    """The in-process monitor kills through nvrx_core.hang_kill: the dump is not waited for (a
    stopped rank writes nothing), SIGTERM goes with SIGCONT, and the rank's handler ends it long
    before the 600 s grace would have brought SIGKILL (a bare SIGTERM left it stopped till then).

    The monitor is held stopped until the test has seen the rank stopped (before: its 2 s hard
    timeout ran on while the test polled, and a test thread stalled that long saw the rank
    already killed)."""
    events_file, monitor_pid_file = str(tmp_path / "events.jsonl"), str(tmp_path / "monitor.pid")
    rank = warm_python.forkserver_context().Process(target=_rank_that_stops, args=(events_file, monitor_pid_file))
    rank.start()
    monitor = None
    try:
        states = []
        wait_for(lambda: states.append(process_state(rank.pid)) or states[-1] in ("stopped", "zombie", None),
                 timeout=60, what="the rank stopped")
        assert states[-1] == "stopped", states  # it stopped before its hard timeout (2 s) ran out
        with open(monitor_pid_file) as f:
            monitor = int(f.read())
        os.kill(monitor, signal.SIGCONT)      # its hard timeout may run out now
        rank.join(120)
        assert rank.exitcode == HANDLED_BY_EXIT
        killed = [e for e in read_events(events_file) if e["kind"] == RANK_KILLED]
        assert [(e["signal"], e["reason"]) for e in killed] == [("SIGTERM", "hard_timeout")], killed
    finally:
        if rank.is_alive():
            rank.kill()
            rank.join()
        if monitor is None and os.path.exists(monitor_pid_file):
            with open(monitor_pid_file) as f:
                monitor = int(f.read())
        if monitor is not None:
            try:
                os.kill(monitor, signal.SIGCONT)  # a monitor left stopped would never see its rank gone
            except ProcessLookupError:
                pass
