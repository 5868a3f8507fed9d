"""Store coordination, main-thread interruption and the hard-timeout monitor, in one process.

A real TCPStore hosted by the test; each "rank" is a Coordinator with its own client,
driven from threads. The monitor process is tested around a real child process.
"""

import datetime
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import torch.distributed as dist
from harness import wait_for

from nvrx_core.events import EventLog
from nvrx_core.inprocess import InProcessConfig
from nvrx_core.inprocess.coordination import POLL_MAX, POLL_MAX_FIRST_SECOND, POLL_MIN, Coordinator, HeartbeatWatch, Poller
from nvrx_core.inprocess.errors import BarrierTimeout, RestartRequested
from nvrx_core.inprocess.interruption import MainThreadInterrupter, MainThreadProgress
from nvrx_core.inprocess.monitor_thread import MonitorThread
from nvrx_core.inprocess.planning import Plan
from nvrx_core.inprocess.records import Cause
from nvrx_core.inprocess.wrapper import _Call
from nvrx_core.inprocess.store import STORE_ENV, StoreSetupError, endpoint_from_env
from harness.clock import FakeClock
from harness.stores import host_store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def store():
    server = host_store()
    yield server


def coordinators(server, count, prefix="test"):
    return [Coordinator(dist.TCPStore("127.0.0.1", server.port, is_master=False), prefix, r) for r in range(count)]


def test_initial_barrier_returns_every_rank_node(store):
    coords = coordinators(store, 3)
    results = {}
    threads = [threading.Thread(target=lambda c=c: results.update({c.rank: c.initial_barrier(f"node{c.rank // 2}", 3, 10)}))
               for c in coords]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert results == {r: ["node0", "node0", "node1"] for r in range(3)}


def test_initial_barrier_times_out_naming_the_count(store):
    with pytest.raises(BarrierTimeout, match="only 1 of 2 ranks"):
        coordinators(store, 1)[0].initial_barrier("n", 2, 0.3)


def test_first_record_and_first_termination_claim_win(store):
    a, b = coordinators(store, 2)
    first = a.record(0, Cause.EXCEPTION, "boom")
    second = b.record(0, Cause.PEER_INTERRUPTED)
    assert first.first and not second.first
    assert [(r.rank, r.cause) for r in b.records(0)] == [(0, Cause.EXCEPTION), (1, Cause.PEER_INTERRUPTED)]
    assert a.mark_terminated(1, Cause.HEARTBEAT_LOST) and not b.mark_terminated(1, Cause.EXITED)
    assert a.terminated() == {1: "heartbeat_lost"} and a.terminated_count() == 1
    assert a.interrupted(1, terminated_base=0) and not a.interrupted(1, terminated_base=1)


def test_barrier_completes_with_a_silent_member_declared_lost(store):
    coords = coordinators(store, 3)
    for c in coords:
        c.heartbeat()
    lost = []

    def declare(rank):
        if coords[0].mark_terminated(rank, Cause.HEARTBEAT_LOST):
            lost.append(rank)

    stop = threading.Event()

    def keep_beating():  # ranks 0 and 1 stay alive; rank 2 never arrives nor beats again
        while not stop.wait(0.05):
            coords[0].heartbeat()
            coords[1].heartbeat()

    beat = threading.Thread(target=keep_beating)
    beat.start()
    coords[1].arrive(0)
    coords[0].arrive(0)
    began = time.monotonic()
    try:
        arrived, terminated = coords[0].wait_for_members(0, [0, 1, 2], 0, timeout=10, heartbeat_timeout=0.5,
                                                         heartbeat_interval=0.1, on_lost=declare)
    finally:
        stop.set()
        beat.join()
    assert arrived == {0, 1} and terminated == {2: "heartbeat_lost"} and lost == [2]
    assert time.monotonic() - began < 5


def test_barrier_timeout_names_the_missing_ranks(store):
    coords = coordinators(store, 2)
    coords[0].arrive(0)
    with pytest.raises(BarrierTimeout, match=r"ranks \[1\] did not arrive"):
        coords[0].wait_for_members(0, [0, 1], 0, timeout=0.3, heartbeat_timeout=100, heartbeat_interval=100,
                                   on_lost=lambda r: None)


def test_plan_proposal_first_writer_wins(store):
    a, b = coordinators(store, 2)
    assert a.propose_plan(3, "plan-a") == "plan-a"
    assert b.propose_plan(3, "plan-b") == "plan-a"
    assert b.wait_for_plan(3, 1) == "plan-a"


def test_heartbeat_watch_uses_its_own_clock():
    now = [100.0]
    watch = HeartbeatWatch(clock=lambda: now[0])
    watch.update({1: b"5", 2: b"9"})
    now[0] += 3
    watch.update({1: b"6", 2: b"9"})
    assert watch.stale(2.0) == [2]


def test_poller_stays_tight_for_the_first_second_then_backs_off():
    """A replacement joins ~0.1 s into a wait: its polls must not be 50 ms apart then."""
    clock, slept = FakeClock(), []

    def sleep(seconds):
        slept.append(seconds)
        clock.advance(seconds)

    poller = Poller(sleep=sleep, clock=clock)
    while clock.now - 1000.0 < 3.0:
        poller.wait()
    first_second = [s for s, at in zip(slept, _elapsed(slept)) if at < 1.0]
    assert slept[0] == POLL_MIN
    assert max(first_second) <= POLL_MAX_FIRST_SECOND
    assert max(slept) == POLL_MAX


def _elapsed(sleeps):
    """When each sleep began, counted from the first."""
    at, out = 0.0, []
    for seconds in sleeps:
        out.append(at)
        at += seconds
    return out


def test_store_endpoint_prefers_an_external_store_then_the_agents():
    agent = {"MASTER_ADDR": "h", "MASTER_PORT": "100", "TORCHELASTIC_USE_AGENT_STORE": "True",
             "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "2"}
    e = endpoint_from_env(agent)
    assert (e.host, e.port, e.hosted_by_rank0, e.key_prefix) == ("h", 100, False, "nvrx_inprocess/job/2")
    assert endpoint_from_env({**agent, STORE_ENV: "s:7"}).port == 7
    plain = endpoint_from_env({"MASTER_ADDR": "h", "MASTER_PORT": "100"})
    assert plain.hosted_by_rank0 and plain.port == 101
    with pytest.raises(StoreSetupError, match="MASTER_ADDR"):
        endpoint_from_env({})
    with pytest.raises(StoreSetupError, match="expected host:port"):
        endpoint_from_env({STORE_ENV: "nope"})


# ---- interrupting the main thread ---------------------------------------------------------
@pytest.fixture
def interrupter():
    it = MainThreadInterrupter(signal.SIGUSR1)
    it.install()
    yield it
    it.disarm()
    it.uninstall()


def request_later(interrupter, delay=0.2):
    timer = threading.Timer(delay, interrupter.request, args=("test",))
    timer.start()
    return timer


_CLOCK_NANOSLEEP = {"x86_64": 230, "aarch64": 115}.get(os.uname().machine)   # time.sleep's syscall


def _blocked_sleeping(tid: int) -> bool:
    """Whether thread `tid` of this process is inside time.sleep's clock_nanosleep(2), as the
    kernel says (on another architecture: inside any system call)."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return False
    if not fields or fields[0] in ("running", "-1"):
        return False
    return _CLOCK_NANOSLEEP is None or int(fields[0]) == _CLOCK_NANOSLEEP


def test_armed_interruption_breaks_a_blocking_sleep(interrupter):
    """The request comes once the main thread sleeps (before: on a 0.2 s timer, which a main
    thread stalled as long let fire before the sleep, outside pytest.raises)."""
    interrupter.arm()
    main = threading.main_thread().native_id

    def request_once_sleeping():
        wait_for(lambda: _blocked_sleeping(main), timeout=120, what="the main thread inside time.sleep")
        interrupter.request("test")

    requester = threading.Thread(target=request_once_sleeping)
    requester.start()
    try:
        began = time.monotonic()
        with pytest.raises(RestartRequested, match="test"):
            time.sleep(10)
        assert time.monotonic() - began < 5
    finally:
        requester.join()


def test_unarmed_interruption_is_dropped_not_deferred(interrupter):
    """Outside the wrapped function a request is dropped: arming later must not raise a stale one."""
    request_later(interrupter, 0.05).join()                      # a monitor's request, unarmed
    signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)  # the signal itself, unarmed
    sum(len(str(i)) for i in range(1000))   # Python calls: the pending handler runs (and returns)
    assert interrupter.late_requests == 0   # not counted as a request against fn's own frames
    interrupter.arm()
    with interrupter.atomic():              # nothing was deferred either
        sum(len(str(i)) for i in range(1000))
    with pytest.raises(RestartRequested, match="armed now"):   # and an armed request still lands
        interrupter.request("armed now")
        wait_for(lambda: False, timeout=20, what="the armed request to raise")


def test_atomic_block_defers_the_interruption_to_its_end(interrupter):
    interrupter.arm()
    finished_block = False
    with pytest.raises(RestartRequested):
        with interrupter.atomic():
            request_later(interrupter, 0.05).join()
            time.sleep(0.2)
            finished_block = True
    assert finished_block


def _blocked_reading(tid: int, fd: int) -> bool:
    """Whether thread `tid` of this process is inside a read(2) of `fd`, as the kernel says
    (/proc's syscall file: the call's number, then its arguments; read's first is the fd)."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return False
    return len(fields) > 1 and fields[0] not in ("running", "-1") and int(fields[1], 16) == fd


def test_progress_stops_while_the_main_thread_is_blocked_in_c():
    """poke() queues a call the main thread runs between two bytecodes: it stamps the clock
    while Python runs, and not while the main thread is blocked in C. On a FakeClock: what is
    judged is whether the stamp moved, not how soon a loaded host ran the threads."""
    clock = FakeClock()
    progress = MainThreadProgress(clock=clock)
    clock.advance(10.0)
    progress.poke()
    wait_for(lambda: progress.idle_for() == 0.0, what="the poke's call run by the main thread running Python")

    read_end, write_end = os.pipe()
    seen = {}

    def while_blocked():
        main = threading.main_thread().native_id
        wait_for(lambda: _blocked_reading(main, read_end), what="the main thread blocked in read(2)")
        clock.advance(5.0)
        progress.poke()
        seen["idle"] = progress.idle_for()
        seen["clock"] = clock.now
        os.write(write_end, b"x")

    helper = threading.Thread(target=while_blocked)
    helper.start()
    try:
        assert os.read(read_end, 1) == b"x"  # a C call: no bytecode, so no progress while it lasts
    finally:
        helper.join()
        os.close(read_end)
        os.close(write_end)
    assert seen["idle"] == 5.0, "progress advanced while the main thread was blocked"
    wait_for(lambda: progress.last == seen["clock"], what="progress resumed once Python ran again")


# ---- the hard-timeout monitor process -----------------------------------------------------
RANK_STANDIN = textwrap.dedent("""
    import ctypes, os, sys, time
    from nvrx_core.inprocess.monitor_process import MonitorProcess, MonitorSettings
    marker = sys.argv[2]
    def declare(cause, detail):
        open(marker, "w").write(cause.value)
    hard_timeout = float(sys.argv[3])
    monitor = MonitorProcess(MonitorSettings(rank=3, hard_timeout=hard_timeout, termination_grace=0.5,
                                             termination_signal=15, interval=0.05), declare)
    monitor.start()
    print(monitor.pid, flush=True)
    mode = sys.argv[1]
    if mode == "gil":
        ctypes.PyDLL(None).sleep(60)   # holds the GIL: no progress can be reported
    elif mode == "exit":
        os._exit(3)
    elif mode == "stop":   # outlives the hard timeout twice over, reporting progress all along
        until = time.monotonic() + 2 * hard_timeout
        while time.monotonic() < until:
            monitor.report_progress(time.monotonic())
            time.sleep(0.05)
        monitor.stop()
""")


def run_standin(tmp_path, mode, hard_timeout=1.0):
    """A hang or death is judged after 1 s (a load only makes the verdict later); the rank that
    reports progress gets 2 s (40 reports apart), so a loaded host cannot make it look hung."""
    marker = tmp_path / "declared"
    proc = subprocess.Popen([sys.executable, "-c", RANK_STANDIN, mode, str(marker), str(hard_timeout)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    monitor_pid = int(proc.stdout.readline())
    try:
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{monitor_pid}"):
        time.sleep(0.05)
    return code, (marker.read_text() if marker.exists() else None)


@pytest.mark.timeout(60)
def test_monitor_kills_a_rank_holding_the_gil(tmp_path):
    code, declared = run_standin(tmp_path, "gil")
    assert code == -signal.SIGTERM and declared == "hard_timeout"


@pytest.mark.timeout(60)
def test_monitor_declares_a_rank_that_died(tmp_path):
    code, declared = run_standin(tmp_path, "exit")
    assert code == 3 and declared == "exited"


@pytest.mark.timeout(60)
def test_monitor_stays_quiet_when_the_rank_leaves_normally(tmp_path):
    code, declared = run_standin(tmp_path, "stop", hard_timeout=2.0)
    assert code == 0 and declared is None


def test_clear_frames_frees_what_chained_errors_kept_alive():
    """A failed iteration's objects (its DDP model, its process group) must not outlive _restart."""
    import gc
    import weakref

    from nvrx_core.inprocess.errors import clear_frames

    class Group:
        pass

    refs = []

    def all_reduce():
        group = Group()  # what torch.distributed resolves into a local before it fails
        refs.append(weakref.ref(group))
        raise RuntimeError("Connection closed by peer")

    def collective():
        try:
            all_reduce()
        except RuntimeError:
            raise KeyboardInterrupt  # the interruption, raised while the first error is handled

    try:
        collective()
    except BaseException as e:
        error = e
    assert refs[0]() is not None and isinstance(error.__context__, RuntimeError)
    clear_frames(error)
    gc.collect()
    assert refs[0]() is None


@pytest.mark.parametrize("given, expected", [(None, 1.5), (datetime.timedelta(seconds=40), 40.0)])
def test_gloo_group_gets_the_wrappers_timeout_unless_told_otherwise(store, given, expected):
    """A receive gloo posted on an already-aborted connection never fails: the group's timeout bounds it."""
    import torch

    from nvrx_core.inprocess.state import RestartState

    state = RestartState(iteration=0, rank=0, world_size=1, initial_rank=0, initial_world_size=1, local_rank=0,
                         store=dist.PrefixStore(f"t{expected}", store), _gloo_timeout=1.5)
    state.init_process_group("gloo", timeout=given)
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert backend.options._timeout.total_seconds() == expected
    finally:
        dist.destroy_process_group()


def test_a_soft_timeout_whose_record_ends_the_iteration_first_is_still_the_rank_s_cause(store):
    """The record of a rank's soft timeout lets its peers abort, and the rank's own collective
    fails, before its monitor's trigger() ran (seen in a loaded CI run: every rank then said
    "peer_interrupted" and no rank named the hang). The main thread must classify that exit as
    the rank's soft timeout. Driven by hand: the classification runs inside the record call."""
    [coord] = coordinators(store, 1, prefix="race")
    config = InProcessConfig(soft_timeout=2.0, hard_timeout=5.0, barrier_timeout=60.0, monitor_interval=0.2)
    monitor = MonitorThread(coord, config, interrupter=types.SimpleNamespace(request=lambda msg: None, armed=False),
                            progress=types.SimpleNamespace(touch=lambda: None, idle_for=lambda now: 3.0),
                            abort=types.SimpleNamespace(abort_communication=lambda: 0),
                            events=EventLog(None, source="test"))
    monitor.begin_iteration(0, [0], terminated_base=coord.terminated_count())
    monitor.enter_function()
    plan = Plan(iteration=0, assignment=None, marked=coord.terminated_count())
    wrapper = types.SimpleNamespace(monitor=monitor, coord=coord, rank=0)
    record, classified = coord.record, []

    def record_then_fail(iteration, cause, detail="", rank=None):
        made = record(iteration, cause, detail, rank)
        if not classified:  # the peer aborted on this record; the rank's collective failed at once
            coord.record = record
            classified.append(_Call._classify(wrapper, plan, None, RuntimeError("Connection closed by peer")))
        return made

    coord.record = record_then_fail
    monitor._check_soft_timeout(now=0.0)
    [(cause, detail)] = classified
    assert cause == Cause.SOFT_TIMEOUT and "ran no Python" in detail, (cause, detail)
    assert [r.cause for r in coord.records(0)][0] == Cause.SOFT_TIMEOUT and monitor.triggered == Cause.SOFT_TIMEOUT
