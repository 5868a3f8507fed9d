"""nvrx_core.hang_kill against real child processes: the dump wait, the termination of a stopped
process, the escalation to SIGKILL. Where a wait's length is the question, the wait runs on a
clock the test owns (its sleeps advance it), so the verdict never depends on a loaded machine."""

import os
import signal
import subprocess
import sys

import pytest

from nvrx_core.hang_kill import DUMP_POLL, DUMP_WAIT_LIMIT, dump_stacks, terminate_then_kill
from nvrx_core.proc import ProcessHandle, process_state
from harness import wait_for
from harness.clock import FakeClock

pytestmark = pytest.mark.timeout(120)

# Takes SIGUSR2 (a stack-dump signal) only once a line arrives on stdin: until then it stays pending.
DUMPER = ("import signal, sys, time; signal.signal(signal.SIGUSR2, lambda *a: print('took it', flush=True)); "
          "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2}); print('ready', flush=True); "
          "sys.stdin.readline(); signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2}); time.sleep(120)")
HANDLED_BY_EXIT = 43
# A SIGTERM handler that exits HANDLED_BY_EXIT: a process that dies so ran its handler (it was not SIGKILLed).
TERM_HANDLER = ("import os, signal, time; signal.signal(signal.SIGTERM, lambda *a: os._exit(%d)); "
                "print('ready', flush=True); time.sleep(120)" % HANDLED_BY_EXIT)
TERM_IGNORED = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                "time.sleep(120)")


def _start(code):
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"ready\n"
    return p


@pytest.fixture
def start():
    started = []

    def start_one(code):
        p = _start(code)
        started.append((p, ProcessHandle.open(p.pid)))
        return started[-1]

    yield start_one
    for p, handle in started:
        p.kill()
        p.wait()
        handle.close()


def _stop(p):
    os.kill(p.pid, signal.SIGSTOP)
    wait_for(lambda: process_state(p.pid) == "stopped", what="the child stopped")


def test_the_dump_wait_ends_once_the_process_took_the_signal(start):
    child, handle = start(DUMPER)
    clock, sleeps = FakeClock(), []

    def sleep(seconds):
        clock.advance(seconds)
        sleeps.append(seconds)
        if len(sleeps) == 3:  # pending at two looks (a killed rank would lose its dump): let it take the signal
            assert handle.signal_pending(signal.SIGUSR2)
            child.stdin.write(b"go\n")
            child.stdin.flush()
            assert child.stdout.readline() == b"took it\n"

    began = clock()
    assert dump_stacks(handle, signal.SIGUSR2, grace=0.3, clock=clock, sleep=sleep)
    # taken before the third look; written = taken at two looks in a row
    assert sleeps == [0.3, DUMP_POLL, DUMP_POLL, DUMP_POLL] and clock() - began < DUMP_WAIT_LIMIT


def test_the_dump_wait_gives_up_at_the_limit(start):
    child, handle = start(DUMPER)
    clock = FakeClock()
    began = clock()
    assert not dump_stacks(handle, signal.SIGUSR2, grace=0.3, clock=clock, sleep=clock.advance)
    assert DUMP_WAIT_LIMIT <= clock() - began <= DUMP_WAIT_LIMIT + DUMP_POLL
    assert handle.signal_pending(signal.SIGUSR2)  # never taken: the wait was bounded, not answered


def test_a_stopped_process_s_dump_is_not_waited_for(start):
    child, handle = start(DUMPER)
    _stop(child)
    clock = FakeClock()
    assert dump_stacks(handle, signal.SIGUSR2, grace=0.3, clock=clock, sleep=clock.advance)
    assert clock.now == FakeClock().now + 0.3  # the grace, then nothing: it writes nothing until continued


def test_a_stopped_process_is_continued_so_its_termination_handler_runs(start):
    """Without SIGCONT a stopped process with a SIGTERM handler stays stopped until the SIGKILL
    that follows the grace: the handler (the Wrapper's, a script's) never runs."""
    child, handle = start(TERM_HANDLER)
    _stop(child)
    assert not terminate_then_kill(handle, signal.SIGTERM, grace=60.0)  # exited within the grace
    assert child.wait(timeout=60) == HANDLED_BY_EXIT


def test_a_process_that_survives_the_grace_is_killed(start):
    child, handle = start(TERM_IGNORED)
    clock = FakeClock()
    assert terminate_then_kill(handle, signal.SIGTERM, grace=5.0, clock=clock, sleep=clock.advance)
    assert child.wait(timeout=60) == -signal.SIGKILL


def test_nothing_is_sent_to_a_process_that_is_gone():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    handle = ProcessHandle.open(p.pid)
    p.wait()
    try:
        clock = FakeClock()
        assert not dump_stacks(handle, signal.SIGUSR2, grace=0.3, clock=clock, sleep=clock.advance)
        assert not terminate_then_kill(handle, signal.SIGTERM, grace=5.0, clock=clock, sleep=clock.advance)
        assert clock.now == FakeClock().now  # nothing waited for
    finally:
        handle.close()
