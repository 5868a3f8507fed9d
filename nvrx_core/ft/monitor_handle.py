"""The launcher's handle on its node monitor process: start it, supervise it, talk to it, stop it.

The launcher binds the listening socket itself (in a private 0700 directory, socket 0600)
and hands the descriptor to the monitor, so ranks can connect the moment the socket exists
and no readiness handshake is needed. The launcher keeps the descriptor open for the whole
job: if the monitor dies, a new one is started on the very same socket (the path the ranks
know), with the current restart cycle and the current workers to adopt. Connections made
meanwhile wait in the socket's backlog for the new monitor. A monitor that keeps dying
(more than `restart_limit` restarts within `restart_window` seconds) is given up on:
MonitorLost, and the launcher stops the job (ExitCode.MONITOR_LOST) rather than train unwatched.

Workers to adopt are passed as pidfds the launcher opened when it started them, so the new
monitor can never mistake a process that reused a worker's pid for that worker.
"""

import collections
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, Optional

from nvrx_core import events as ev
from nvrx_core.exit_codes import describe
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.protocol import decode, encode
from nvrx_core.proc import ProcessHandle

logger = logging.getLogger("nvrx.ft.launcher")


class MonitorLost(RuntimeError):
    """The node monitor keeps dying: hang detection cannot be kept up on this node."""


class MonitorHandle:
    def __init__(self, config: FTConfig, events_file: Optional[str], restart_limit: int = 5,
                 restart_window: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self._config_json = json.dumps(config.to_json())
        self._events_file = events_file
        self._events = ev.EventLog(events_file, source="launcher")
        self._restart_limit = restart_limit
        self._restart_window = restart_window
        self._clock = clock
        self._restarts: collections.deque = collections.deque()
        self.cycle = 0
        self._workers: Dict[int, ProcessHandle] = {}  # global rank -> worker of the current cycle
        self.directory = tempfile.mkdtemp(prefix="nvrx-ft-")
        os.chmod(self.directory, 0o700)
        self.socket_path = os.path.join(self.directory, "monitor.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.socket_path)
        os.chmod(self.socket_path, 0o600)
        self._listener.listen(1024)
        self._control: Optional[socket.socket] = None
        self.process = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        fds = [self._listener.fileno()]
        cmd = [
            sys.executable, "-m", "nvrx_core.ft.monitor",
            "--fd", str(self._listener.fileno()),
            "--config-json", self._config_json,
            "--parent-pid", str(os.getpid()),
            "--cycle", str(self.cycle),
        ]
        if self._events_file:
            cmd += ["--events-file", self._events_file]
        adopt = [(rank, h) for rank, h in sorted(self._workers.items()) if h.by_pidfd and not h.exited()]
        if adopt:
            cmd += ["--adopt", ",".join(f"{rank}:{h.pid}:{h.fileno()}" for rank, h in adopt)]
            fds += [h.fileno() for _, h in adopt]
        return subprocess.Popen(cmd, pass_fds=fds, stdin=subprocess.DEVNULL)

    # ---- supervision -----------------------------------------------------------
    def is_alive(self) -> bool:
        return self.process.poll() is None

    def ensure_running(self) -> bool:
        """Restart the monitor if it has died (True if it was); MonitorLost if it keeps dying."""
        code = self.process.poll()
        if code is None:
            return False
        now = self._clock()
        while self._restarts and now - self._restarts[0] > self._restart_window:
            self._restarts.popleft()
        old_pid = self.process.pid
        if len(self._restarts) >= self._restart_limit:
            raise MonitorLost(f"the node monitor died {len(self._restarts) + 1} times within "
                              f"{self._restart_window:.0f} s (last: {describe(code)}); not restarting it again")
        self._close_control()
        try:
            self.process = self._spawn()
        except OSError as e:
            raise MonitorLost(f"cannot restart the node monitor: {e}") from None
        self._restarts.append(now)
        logger.error("the node monitor (pid %d) died (%s); restarted it (pid %d) on the same socket; "
                     "ranks re-register with it", old_pid, describe(code), self.process.pid)
        self._events.emit(ev.MONITOR_RESTARTED, cycle=self.cycle, old_pid=old_pid, new_pid=self.process.pid,
                          exit=describe(code), adopted=sorted(self._workers))
        return True

    def workers_started(self, pids: Dict[int, int]) -> None:
        """The workers of the current cycle ({global rank: pid}), held by pidfd from now on so a
        restarted monitor can adopt them. Call right after starting them."""
        self._release_workers()
        for rank, pid in pids.items():
            try:
                self._workers[rank] = ProcessHandle.open(pid)
            except OSError:
                pass  # already gone: the agent sees it fail

    def worker_replaced(self, rank: int, pid: int) -> None:
        """Rank `rank` runs as `pid` from now on (respawn-rank replaced its dead process); the
        other ranks' entries stay."""
        old = self._workers.pop(rank, None)
        if old is not None:
            old.close()
        try:
            self._workers[rank] = ProcessHandle.open(pid)
        except OSError:
            pass  # already gone: the agent sees it fail

    def _release_workers(self) -> None:
        for handle in self._workers.values():
            handle.close()
        self._workers.clear()

    # ---- control requests ------------------------------------------------------
    def request(self, msg_type: str, timeout: float = 10.0, **fields) -> dict:
        """Send a control request and wait for the reply (restarting a dead monitor first)."""
        self.ensure_running()
        try:
            return self._exchange(encode(msg_type, **fields), timeout)
        except OSError:
            self._close_control()  # a reply may still come on it later: never read it as this one's
            if not self.ensure_running():
                raise
            return self._exchange(encode(msg_type, **fields), timeout)  # the monitor died meanwhile

    def _exchange(self, data: bytes, timeout: float) -> dict:
        if self._control is None:
            self._control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._control.settimeout(timeout)
            self._control.connect(self.socket_path)
        self._control.settimeout(timeout)
        self._control.sendall(data)
        buf = b""
        while b"\n" not in buf:
            chunk = self._control.recv(65536)
            if not chunk:
                raise ConnectionError("node monitor closed the control connection")
            buf += chunk
        reply = decode(buf.split(b"\n", 1)[0])
        if reply["t"] == "error":
            raise ConnectionError(f"node monitor refused the request: {reply.get('reason')}")
        return reply

    def _close_control(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None

    def new_cycle(self, cycle: int) -> None:
        self.cycle = cycle
        self.request("cycle", cycle=cycle)

    def cycle_stats(self) -> dict:
        return self.request("stats")["stats"]

    def stop(self, timeout: float = 5.0) -> None:
        """End the monitor: a "stop" request, then SIGKILL if it has not exited within `timeout`.
        Not SIGTERM: the monitor ignores stop signals, which the scheduler sends the whole job."""
        if self.process.poll() is None:
            deadline = time.monotonic() + timeout
            try:
                self._exchange(encode("stop"), timeout)
            except (OSError, ValueError) as e:  # stopped, hung, or died meanwhile
                logger.info("the node monitor did not take the stop request (%s)", e)
            try:
                self.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close_control()
        self._release_workers()
        self._listener.close()
        shutil.rmtree(self.directory, ignore_errors=True)
