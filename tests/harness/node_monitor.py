"""A NodeMonitor serving from a thread of the test process, and ranks as real child processes.

The monitor object is real (sockets, JSON lines, deadlines, pidfds); only what a test
chooses is injected (signals recorded or not sent, the clock, credentials). Ranks run
tests/scripts/ft_rank.py: a real RankMonitorClient in a process of its own, which the monitor
may really signal. (Not to be confused with nvrx_core.inprocess.monitor_thread.MonitorThread,
the in-process Wrapper's product thread: this is a test harness around the FT node monitor.)
"""

import os
import signal
import socket
import subprocess
import sys
import threading

from nvrx_core.events import EventLog, read_events
from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.kills import signal_by_handle
from nvrx_core.ft.monitor import NodeMonitor

from harness.waiting import wait_for

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


class NodeMonitorOnThread:
    """A real NodeMonitor polled by a thread of the test process.

    `listener`: serve on a copy of this listening socket (a 'restarted' monitor), else a new one.
    `record_only`: signals are recorded in `signals` and never sent (the "hung" rank may be the
    test process itself). Other keyword arguments go to NodeMonitor (clock=FakeClock(), ...).
    """

    def __init__(self, tmp_path, listener=None, config=None, record_only=False, **monitor_kwargs):
        self.path = str(tmp_path / "m.sock")
        if listener is None:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(self.path)
            listener.listen(64)
        self.listener = listener
        self.signals = []  # (pid, signal) of every signal the monitor delivered, in order
        self.events_file = str(tmp_path / "events.jsonl")

        self.attempts = []  # (pid, signal) of every signal it tried to send

        def record_then_send(watch, sig):
            self.attempts.append((watch.pid, signal.Signals(sig)))
            delivered = signal_by_handle(watch, sig)
            if delivered:
                self.signals.append((watch.pid, signal.Signals(sig)))
            return delivered

        def record_only_send(watch, sig):
            self.attempts.append((watch.pid, signal.Signals(sig)))
            self.signals.append((watch.pid, signal.Signals(sig)))
            return True

        monitor_kwargs.setdefault("send_signal", record_only_send if record_only else record_then_send)
        self.monitor = NodeMonitor(listener.dup(), config or FTConfig(stack_dump_grace=0.05),
                                   EventLog(self.events_file, source="monitor"), **monitor_kwargs)
        self._stop = False
        self._paused = False
        self.error = None  # what ended the serving thread early, raised again by close()
        self._polling = threading.Lock()
        self.polls = 0  # polls completed: a test waits for new ones after advancing a fake clock
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            while not self._stop:
                with self._polling:
                    if not self._paused:
                        self.monitor.poll(0.02)
                        self.polls += 1
                if self._paused:
                    threading.Event().wait(0.01)
        except BaseException as e:  # a monitor that died must fail the test, not fall silent
            self.error = e
            raise

    def pause(self):
        """Stop serving (like a SIGSTOPped monitor), once the current poll is over."""
        self._paused = True
        with self._polling:
            pass

    def resume(self):
        self._paused = False

    def watch(self, pid):
        """The watch of the connected rank `pid` (None if not connected)."""
        for conn in list(self.monitor._conns.values()):
            if conn.watch is not None and conn.watch.pid == pid:
                return conn.watch
        return None

    def wait_polls(self, count=2):
        """Return once the monitor has polled `count` more times (has seen the clock's new time)."""
        target = self.polls + count
        wait_for(lambda: self.polls >= target or self.error is not None, what=f"{count} monitor polls")

    def client(self):
        """A RankMonitorClient of this test process, connected."""
        c = RankMonitorClient(socket_path=self.path)
        assert c.init_workload_monitoring()
        return c

    def events(self, kind):
        return [e for e in read_events(self.events_file) if e["kind"] == kind]

    def close(self):
        """Stop and close the monitor (its connections end); the listener given stays open."""
        self._stop = True
        self.thread.join(10)
        self.monitor.close()
        if self.error is not None:
            raise AssertionError("the monitor's serving thread died") from self.error


class Rank:
    """tests/scripts/ft_rank.py connected to the monitor at `socket_path`."""

    def __init__(self, socket_path, rank=0):
        env = dict(os.environ, NVRX_FT_MONITOR_SOCKET=socket_path, RANK=str(rank), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "ft_rank.py")], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        line = self.proc.stdout.readline()
        assert line == "ready\n", line
        self.pid = self.proc.pid

    def do(self, *commands):
        for command in commands:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            assert line == f"ok {command.split()[0]}\n", line

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
