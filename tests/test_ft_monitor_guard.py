"""The node monitor as a trust boundary and a process killer: who may talk to it, what it
signals, and that no peer can stall it. Real sockets, real rank processes, real signals
(through pidfds); the monitor serves from a thread of the test process."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from harness.clock import FakeClock
from harness.node_monitor import NodeMonitorOnThread, Rank
from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.ft import kills
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.protocol import decode, encode
from nvrx_core.proc import ProcessHandle
from harness import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cleanup():
    things = []
    yield things.append
    errors = []
    for thing in reversed(things):
        try:
            thing.kill() if isinstance(thing, Rank) else thing.close()
        except Exception as e:  # close the rest first
            errors.append(e)
    if errors:
        raise errors[0]


def _stopped(pid: int) -> bool:
    """Every thread of `pid` stopped: SIGSTOP acts on each thread when it next runs, not at kill()."""
    task_dir = f"/proc/{pid}/task"
    states = []
    for tid in os.listdir(task_dir):
        with open(f"{task_dir}/{tid}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return all(state == "T" for state in states)


def hung_rank_config(**overrides):
    return FTConfig(**{"rank_heartbeat_timeout": 0.5, "initial_rank_heartbeat_timeout": 0.5, "stack_dump_grace": 0.05,
                       "rank_termination_signal": "SIGTERM", "termination_grace": 1.0, **overrides})


def advance_until(monitor, clock, condition, what, step=0.1):
    """Move the monitor's FakeClock by `step` until `condition()`, letting it poll in between."""
    def moved():
        if condition():
            return True
        clock.advance(step)
        monitor.wait_polls(1)
        return False
    wait_for(moved, timeout=60, what=what)


# ---- escalation ------------------------------------------------------------------------------
# The monitor's deadlines run on a FakeClock: the clock moves until the termination signal is
# sent, then stands still while the rank (a real process) reacts, however slowly a loaded host
# runs it; only then does it move past the grace, so what is judged is whether the escalation
# was cancelled, not whether the rank beat a real grace period.
def test_escalation_is_cancelled_once_the_terminated_rank_has_exited(tmp_path, cleanup):
    clock = FakeClock()
    monitor = NodeMonitorOnThread(tmp_path, config=hung_rank_config(), clock=clock)
    cleanup(monitor)
    rank = Rank(monitor.path)
    cleanup(rank)
    rank.do("hb")  # then silence: hung
    advance_until(monitor, clock, lambda: signal.SIGTERM in [s for _, s in monitor.signals], "termination signal")
    assert rank.proc.wait(timeout=30) == -signal.SIGTERM  # it exits on SIGTERM, its connection with it
    wait_for(lambda: monitor.watch(rank.pid) is None, what="the rank's disconnect seen")
    # The monitor looks at a disconnected rank's pidfd again every EXIT_POLL of its clock (the
    # socket closes a moment before the process counts as exited): move it by that, far short
    # of the grace, until the kill's last step is cancelled.
    advance_until(monitor, clock, lambda: monitor.monitor._sched.next_time() is None,
                  "the rank dropped and nothing left scheduled", step=kills.EXIT_POLL)
    clock.advance(10.0)  # far past the grace
    monitor.wait_polls()
    delivered = [s for _, s in monitor.signals]
    assert delivered[:2] == [signal.SIGUSR2, signal.SIGTERM]
    assert signal.SIGKILL not in [s for _, s in monitor.attempts]  # cancelled, not merely sent to nobody


def test_a_rank_that_disconnects_but_keeps_running_is_still_escalated_through_its_pidfd(tmp_path, cleanup):
    monitor = NodeMonitorOnThread(tmp_path, config=hung_rank_config())
    cleanup(monitor)
    rank = Rank(monitor.path)
    cleanup(rank)
    rank.do("on-sigterm-disconnect", "hb")
    assert rank.proc.wait(timeout=30) == -signal.SIGKILL  # still hung after its SIGTERM handler left
    assert [s for _, s in monitor.signals][-1] == signal.SIGKILL


def test_without_pidfds_escalation_is_cancelled_at_disconnect(tmp_path, cleanup):
    """A bare pid proves nothing once its connection is gone: no SIGKILL may follow."""
    clock = FakeClock()
    monitor = NodeMonitorOnThread(tmp_path, config=hung_rank_config(), clock=clock,
                                  open_process=lambda pid: ProcessHandle(pid, None))
    cleanup(monitor)
    rank = Rank(monitor.path)
    cleanup(rank)
    rank.do("on-sigterm-disconnect", "hb")
    advance_until(monitor, clock, lambda: signal.SIGTERM in [s for _, s in monitor.signals], "termination signal")
    wait_for(lambda: monitor.watch(rank.pid) is None and monitor.monitor._sched.next_time() is None,
             what="disconnect seen, escalation cancelled")
    clock.advance(10.0)  # far past the grace
    monitor.wait_polls()
    assert rank.proc.poll() is None and signal.SIGKILL not in [s for _, s in monitor.signals]


# ---- adoption after a monitor restart -----------------------------------------------------------
def test_a_restarted_monitor_kills_an_adopted_rank_that_never_re_registers(tmp_path, cleanup):
    first = NodeMonitorOnThread(tmp_path, config=FTConfig(rank_heartbeat_timeout=1.0))
    cleanup(first)
    stopped, live = Rank(first.path, rank=0), Rank(first.path, rank=1)
    cleanup(stopped)
    cleanup(live)
    stopped.do("hb")
    live.do("hb")
    os.kill(stopped.pid, signal.SIGSTOP)  # frozen: its client cannot reconnect by itself
    wait_for(lambda: _stopped(stopped.pid), what="the SIGSTOPped rank's threads all stopped")
    first.close()
    # The restarted monitor's deadlines run on a FakeClock: the live rank re-registers (its
    # client reconnects from a thread, in real time) while the clock stands still, however
    # long a loaded host takes; then the clock moves past the grace, and only the frozen rank
    # is still unregistered.
    clock = FakeClock()
    unenforced = FTConfig(rank_heartbeat_timeout=None, initial_rank_heartbeat_timeout=None)  # grace: the floor
    second = NodeMonitorOnThread(tmp_path, listener=first.listener, config=unenforced,
                           adopt={0: ProcessHandle.open(stopped.pid), 1: ProcessHandle.open(live.pid)},
                           reregister_floor=3.0, clock=clock)
    cleanup(second)
    wait_for(lambda: second.watch(live.pid) is not None, timeout=60, what="the live rank re-registered on its own")
    clock.advance(2.9)  # within the grace
    second.wait_polls()
    assert stopped.proc.poll() is None and not second.events("fault_detected")

    def killed():
        if stopped.proc.poll() is not None:
            return True
        clock.advance(0.2)  # past the grace, then through the kill's own waits (dump, termination)
        second.wait_polls(1)
        return False

    wait_for(killed, timeout=60, what="the adopted rank that never re-registered killed")
    assert stopped.proc.wait() == -signal.SIGKILL, second.attempts
    [detected] = second.events("fault_detected")
    assert detected["rank"] == 0 and detected["reason"] == "did not re-register with the restarted node monitor"
    assert second.watch(live.pid) is not None and live.proc.poll() is None  # re-registered on its own


# ---- who may connect and what they may say -------------------------------------------------------
def test_a_peer_whose_credentials_cannot_be_read_is_dropped(tmp_path, cleanup):
    """SO_PEERCRED cannot be made to fail on a real Unix socket, so the credentials reader is
    injected: it fails (as the kernel might), then reports no pid."""
    failures = [OSError("SO_PEERCRED: not supported"), (0, 0, 0)]

    def credentials(sock):
        outcome = failures.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monitor = NodeMonitorOnThread(tmp_path, credentials=credentials)
    cleanup(monitor)
    for _ in range(2):
        with pytest.raises(ConnectionError, match="closed the connection|did not register"):
            RankMonitorClient(socket_path=monitor.path).init_workload_monitoring(connect_timeout=10)
    assert not monitor.monitor._conns


CONTROL_PEER = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
                "s.sendall(sys.argv[2].encode() + b'\\n'); print(s.recv(65536).decode(), end='')")


def _control_from_child(path, message: bytes) -> dict:
    out = subprocess.run([sys.executable, "-c", CONTROL_PEER, path, message.decode().strip()],
                         capture_output=True, text=True, timeout=60).stdout
    return decode(out.splitlines()[0].encode())


def test_control_messages_are_accepted_from_the_launcher_only(tmp_path, cleanup):
    monitor = NodeMonitorOnThread(tmp_path, launcher_pid=os.getpid())  # this test process plays the launcher
    cleanup(monitor)
    for message in (encode("cycle", cycle=7), encode("stats")):
        reply = _control_from_child(monitor.path, message)
        assert reply["t"] == "error" and "launcher message; refused" in reply["reason"]
    assert monitor.monitor.cycle == 0
    with socket.socket(socket.AF_UNIX) as launcher:
        launcher.connect(monitor.path)
        launcher.sendall(encode("cycle", cycle=7))
        assert decode(launcher.recv(65536).split(b"\n")[0])["t"] == "ok"
    assert monitor.monitor.cycle == 7

    nobody = NodeMonitorOnThread(tmp_path / "..", launcher_pid=None)  # no launcher named: nobody may
    cleanup(nobody)
    with socket.socket(socket.AF_UNIX) as peer:
        peer.connect(nobody.path)
        peer.sendall(encode("stats"))
        assert decode(peer.recv(65536).split(b"\n")[0])["t"] == "error"


def test_a_flood_of_bad_messages_is_logged_a_few_times_and_never_stalls_the_monitor(tmp_path, cleanup, caplog):
    monitor = NodeMonitorOnThread(tmp_path, config=FTConfig(rank_heartbeat_timeout=60))
    cleanup(monitor)
    rank = Rank(monitor.path)
    cleanup(rank)
    caplog.set_level("WARNING", logger="nvrx.ft.monitor")
    vandal_conn = lambda: [c for c in list(monitor.monitor._conns.values()) if c.peer_pid == os.getpid()]  # noqa: E731
    with socket.socket(socket.AF_UNIX) as vandal:
        vandal.connect(monitor.path)
        vandal.setblocking(False)
        sent = 0
        try:  # up to 20000 bad lines, never reading the error replies
            for _ in range(20000):
                sent += vandal.send(b'{"v":1,"t":"hb"}\n') // 17  # hb before init: an error reply each
        except BlockingIOError:
            pass
        assert sent > 100
        wait_for(lambda: vandal_conn() and vandal_conn()[0].bad_messages >= 100, what="bad messages read")
        rank.do("hb")
        wait_for(lambda: getattr(monitor.watch(rank.pid), "heartbeats", 0) == 1, what="the rank still served")
    wait_for(lambda: not vandal_conn(), what="the vandal's connection dropped")
    # the monitor thread logs the summary as it closes the connection: wait for it, do not race it
    wait_for(lambda: any("bad messages in all" in r.getMessage() for r in caplog.records),
             what="the bad-message summary logged")
    logged = [r for r in caplog.records if "dropped a bad message" in r.getMessage()]
    assert len(logged) == 3


def test_a_peer_that_never_reads_its_replies_is_dropped_without_stalling_the_monitor(tmp_path, cleanup):
    monitor = NodeMonitorOnThread(tmp_path, launcher_pid=os.getpid(), config=FTConfig(rank_heartbeat_timeout=60))
    cleanup(monitor)
    rank = Rank(monitor.path)
    cleanup(rank)
    with socket.socket(socket.AF_UNIX) as greedy:
        greedy.connect(monitor.path)
        start = time.monotonic()
        dropped = False
        while not dropped and time.monotonic() - start < 60:
            try:  # stats requests (about 150 bytes of reply each) it never reads
                greedy.sendall(encode("stats") * 100)
            except OSError:
                dropped = True
            rank.do("hb")
        assert dropped, "the monitor kept queueing replies nobody reads"
        assert monitor.watch(rank.pid).heartbeats > 0
