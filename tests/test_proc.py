"""nvrx_core.proc against real child processes: pending signals, stopped and dead processes."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from nvrx_core.proc import alive, signal_pending, wait_until_taken
from waiting import wait_for

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


def test_wait_until_taken_returns_only_after_the_process_took_the_signal(child):
    os.kill(child.pid, signal.SIGUSR2)
    waiter = threading.Thread(target=wait_until_taken, args=(child.pid, signal.SIGUSR2, 0.05, 60.0))
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive()  # still pending: a monitor would lose the dump if it killed now
    child.stdin.write(b"go\n")
    child.stdin.flush()
    assert child.stdout.readline() == b"took it\n"
    waiter.join(30)
    assert not waiter.is_alive()


def test_wait_until_taken_gives_up_at_the_limit(child):
    os.kill(child.pid, signal.SIGUSR2)
    wait_for(lambda: signal_pending(child.pid, signal.SIGUSR2), what="SIGUSR2 pending")
    start = time.monotonic()
    wait_until_taken(child.pid, signal.SIGUSR2, 0.05, limit=0.5)
    assert signal_pending(child.pid, signal.SIGUSR2) and time.monotonic() - start >= 0.5
