"""nvrx_core.proc against real child processes: pending signals, stopped and dead processes."""

import os
import signal
import subprocess
import sys

import pytest

from nvrx_core.proc import ProcessHandle, alive, signal_pending
from harness import wait_for

pytestmark = pytest.mark.timeout(60)

# Blocks SIGUSR2 (so a sent one stays pending) until a line arrives on stdin.
CHILD = ("import signal, sys, time; signal.signal(signal.SIGUSR2, lambda *a: print('took it', flush=True)); "
         "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2}); print('ready', flush=True); "
         "sys.stdin.readline(); signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2}); time.sleep(60)")


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"ready\n"
    yield p
    p.kill()
    p.wait()


def test_pending_until_taken_and_never_for_a_stopped_or_dead_process(child):
    assert alive(child.pid) and not signal_pending(child.pid, signal.SIGUSR2)
    os.kill(child.pid, signal.SIGUSR2)
    wait_for(lambda: signal_pending(child.pid, signal.SIGUSR2), what="SIGUSR2 pending")
    os.kill(child.pid, signal.SIGSTOP)  # a stopped rank takes nothing: no reason to wait for it
    wait_for(lambda: not signal_pending(child.pid, signal.SIGUSR2), what="stopped state seen")
    assert alive(child.pid)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert not alive(child.pid) and not signal_pending(child.pid, signal.SIGUSR2)


# ---- ProcessHandle: signals by pidfd -------------------------------------------------------
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _reaped_child():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    handle = ProcessHandle.open(p.pid)
    p.wait()  # exited and reaped: its pid is free for any new process
    return handle


def _spawn_with_pid(pid, attempts=200):
    """A sleeper that got `pid` (steered through ns_last_pid); None if other processes kept taking it."""
    for _ in range(attempts):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        p = subprocess.Popen(SLEEPER)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


def test_a_handle_on_an_exited_process_never_signals_the_process_that_reuses_its_pid():
    handle = _reaped_child()
    assert handle.by_pidfd and handle.exited()
    reuser = _spawn_with_pid(handle.pid)
    if reuser is None:
        pytest.skip("cannot steer pid allocation here (needs root and a quiet pid namespace)")
    try:
        assert alive(handle.pid)  # the number is taken again, by an unrelated process
        assert handle.send_signal(signal.SIGKILL) is False
        assert not handle.signal_pending(signal.SIGUSR2)
        with pytest.raises(subprocess.TimeoutExpired):
            reuser.wait(timeout=0.5)  # a bare os.kill(pid, SIGKILL) would have killed it
    finally:
        reuser.kill()
        reuser.wait()
        handle.close()


def test_a_pidfd_handle_signals_by_pidfd_not_by_number():
    """Where pid allocation cannot be steered: a handle whose number names another live
    process (as after reuse) still only signals the process its pidfd was opened for."""
    handle = _reaped_child()
    other = subprocess.Popen(SLEEPER)
    try:
        handle.pid = other.pid  # the number now names a live, unrelated process
        assert handle.send_signal(signal.SIGKILL) is False
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=0.5)
    finally:
        other.kill()
        other.wait()
        handle.close()


def test_a_handle_signals_its_live_process_and_sees_it_exit(child):
    handle = ProcessHandle.open(child.pid)
    try:
        assert not handle.exited()
        assert handle.send_signal(signal.SIGUSR2)
        wait_for(lambda: handle.signal_pending(signal.SIGUSR2), what="SIGUSR2 pending")
        assert handle.send_signal(signal.SIGKILL)
        wait_for(handle.exited, what="exit seen through the pidfd")  # a zombie counts as exited
        assert handle.send_signal(signal.SIGKILL) is False and not handle.signal_pending(signal.SIGUSR2)
    finally:
        handle.close()
    assert handle.send_signal(signal.SIGKILL) is False  # closed: signals nothing


def test_opening_a_handle_on_no_process_is_an_error():
    with pytest.raises(ProcessLookupError):
        ProcessHandle.open(-1)
    handle = _reaped_child()
    pid = handle.pid
    handle.close()
    if not alive(pid):
        with pytest.raises(ProcessLookupError):
            ProcessHandle.open(pid)


def test_a_bare_pid_handle_where_pidfds_are_missing():
    other = subprocess.Popen(SLEEPER)
    handle = ProcessHandle(other.pid, None)
    try:
        assert not handle.by_pidfd and not handle.exited()
        assert handle.send_signal(signal.SIGKILL)
        other.wait()
        assert handle.exited()
    finally:
        other.kill()
        other.wait()
