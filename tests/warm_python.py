"""`python script.py ...` for the tests, forked from a process that already imported torch.

A rank script started as a new interpreter spends about 2 s of CPU importing torch (6 s with
Lightning) before its first line; the suite starts dozens of them, and on a 2-core machine
that CPU is what the other tests wait for. A warm process (one per test process and preload
list) imports once and forks a child for each command. The child is a real process of its own
(pid, signals, exit status) and runs the script the way `python script.py args` does:
`__name__ == "__main__"`, sys.argv, the given environment, working directory and standard
streams, and at the end the interpreter's own exit (atexit handlers, non-daemon threads,
SystemExit codes, a traceback and exit 1 for an uncaught exception). What differs from a new
interpreter is only that the preloaded modules are imported already.

Tests of the launcher's own process handling start real interpreters with subprocess; this
is for the ranks and jobs that those tests do not cover.

Why a fork server of the tests' own, beside the product's (nvrx_core/ft/warm_start.py over
multiprocessing's "forkserver", started by forking where torch is loaded: ft/forked_server.py).
The product's runs ft_launcher's workers, each a multiprocessing Process that runs the script
(`warm_start.run_target`); what the tests need from `popen` it cannot give:
- A Popen handle. The tests drive a child as they drive subprocess.Popen (pid, poll, wait with a
  timeout, send_signal, communicate, returncode -N for a signal; harness.launcher and
  harness.ranks.TorchrunLikeRanks take either). A Process has join, exitcode and a sentinel, and
  only its parent, the process that started it, may wait for it.
- Each child's own standard streams, environment and working directory. A forkserver child has
  the server's stdout, stderr and working directory, stdin replaced by /dev/null (Process
  bootstrap), and the environment the server started with; run_target applies only the one set of
  changes the launcher made since then. Tests read a rank's output through a pipe or a log file,
  write to its stdin, and give each rank its own RANK, cwd, PYTHONPATH.
- The interpreter's own exit. A Process ends with os._exit after its target: multiprocessing's
  finalizers and non-daemon threads run, atexit handlers (logging.shutdown's among them) never
  do; `python script.py` runs them, and test_warm_python checks that a popen child does.
- A preload per kind of job. multiprocessing keeps one fork server per process, its preload fixed
  when it starts; the tests need torch alone, torch with Lightning, and torch with the launcher
  (LIGHTNING, LAUNCHER below), one warm process each, in the same test process.
- ft_launcher itself as the child (harness.launcher.run_launcher): the launcher under test must be
  a plain main process holding torch, which then forks its own fork server (forked_server's path,
  tested that way), not a worker inside another launcher's machinery.
`forkserver_context()` below is no second mechanism: it is multiprocessing's fork server, the one
the product builds on, for tests whose ranks are Process targets (harness.ranks.spawn_ranks).
"""

import atexit
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

TORCH = ("torch", "torch.distributed")
LIGHTNING = (*TORCH, "lightning.pytorch")
LAUNCHER = (*TORCH, "nvrx_core.ft.launcher")

# What multiprocessing's fork server imports for the tests that start ranks as Process targets.
FORKSERVER_PRELOAD = [*TORCH, "torch._dynamo", "nvrx_core.inprocess"]

PIPE = subprocess.PIPE
STDOUT = subprocess.STDOUT
DEVNULL = subprocess.DEVNULL

_WARM_MAIN = r'''
import importlib, json, os, runpy, selectors, signal, socket, sys

def _pythonpath():
    return [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


_OWN_PYTHONPATH = _pythonpath()
for _name in sys.argv[2:]:
    importlib.import_module(_name)
_ctl = socket.socket(fileno=int(sys.argv[1]))


def _serve():
    """Fork a child per request; report each child's pid and exit status. Returns in a child."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(_ctl, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is _ctl:
                msg, fds, _, _ = socket.recv_fds(_ctl, 1 << 20, 3)
                if not msg:
                    os._exit(0)  # the test process is gone
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    return json.loads(msg), fds
                for fd in fds:
                    os.close(fd)
                _ctl.sendall(json.dumps({"started": pid}).encode() + b"\n")
            else:
                os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _ctl.sendall(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


_request, _fds = _serve()
_ctl.close()
for _target, _fd in zip((0, 1, 2), _fds):
    os.dup2(_fd, _target)
for _fd in set(_fds):
    if _fd > 2:
        os.close(_fd)
os.environ.clear()
os.environ.update(_request["env"])
os.chdir(_request["cwd"])
for _entry in _OWN_PYTHONPATH:  # sys.path as the child's own PYTHONPATH would make it
    if _entry in sys.path:
        sys.path.remove(_entry)
sys.path[1:1] = _pythonpath()
if _request["new_session"]:
    os.setsid()
if os.environ.get("PYTHONUNBUFFERED"):  # what -u or the variable gives a new interpreter
    for _stream in (sys.stdout, sys.stderr):
        _stream.reconfigure(line_buffering=True, write_through=True)
if "OMP_NUM_THREADS" in os.environ and "torch" in sys.modules:
    # OpenMP read the variable when torch loaded it, in the warm process
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
_argv = _request["argv"]
if _argv[0] == "-m":
    sys.argv = [_argv[1], *_argv[2:]]
    sys.path[0] = os.getcwd()
    runpy.run_module(_argv[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = list(_argv)
    sys.path[0] = os.path.dirname(os.path.abspath(_argv[0]))
    runpy.run_path(_argv[0], run_name="__main__")
'''


class WarmProcess:
    """The subset of subprocess.Popen the tests use."""

    def __init__(self, server: "_WarmServer", pid: int, args: List[str], stdin, stdout, stderr):
        self._server, self.pid, self.args = server, pid, args
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: Optional[int] = None
        self._readers: Optional[List[threading.Thread]] = None
        self._read: Dict[str, object] = {}

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            code = self._server.exit_code(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)

    def communicate(self, timeout: Optional[float] = None):
        """Read stdout and stderr to the end and wait for the exit, within `timeout`; after a
        TimeoutExpired, a later call goes on reading where the first left off (as Popen's)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._readers is None:
            self._readers = [threading.Thread(target=lambda n=n, s=s: self._read.__setitem__(n, s.read()),
                                              daemon=True)
                             for n, s in (("out", self.stdout), ("err", self.stderr)) if s]
            for reader in self._readers:
                reader.start()
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._read.get("out"), self._read.get("err")


class _WarmServer:
    def __init__(self, preload: Sequence[str]):
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, "-c", _WARM_MAIN, str(theirs.fileno()), *preload],
                                      pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()          # one start request at a time
        self._cond = threading.Condition()
        self._started: List[int] = []
        self._exits: Dict[int, int] = {}
        self._closed = False
        threading.Thread(target=self._read, name="warm-python-reader", daemon=True).start()

    def _read(self) -> None:
        buf = b""
        while True:
            data = self._sock.recv(65536)
            with self._cond:
                if not data:
                    self._closed = True
                    self._cond.notify_all()
                    return
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    msg = json.loads(line)
                    if "started" in msg:
                        # a reused pid: an earlier child's exit is not this one's
                        self._exits.pop(msg["started"], None)
                        self._started.append(msg["started"])
                    else:
                        self._exits[msg["exited"]] = msg["code"]
                self._cond.notify_all()

    def start(self, argv: List[str], env: Dict[str, str], cwd: str, fds: List[int], new_session: bool) -> int:
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "new_session": new_session}).encode()
        with self._lock:
            socket.send_fds(self._sock, [request], fds)
            with self._cond:
                if not self._cond.wait_for(lambda: self._started or self._closed, timeout=120):
                    raise RuntimeError("the warm python process did not start a child in 120 s")
                if not self._started:
                    raise RuntimeError(f"the warm python process exited ({self._proc.poll()})")
                return self._started.pop(0)

    def exit_code(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._closed, timeout=timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        self._sock.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


_SERVERS: Dict[tuple, _WarmServer] = {}
_SERVERS_LOCK = threading.Lock()


def _server(preload: Sequence[str]) -> _WarmServer:
    key = tuple(preload)
    with _SERVERS_LOCK:
        if key not in _SERVERS:
            if not _SERVERS:
                atexit.register(lambda: [s.close() for s in _SERVERS.values()])
            _SERVERS[key] = _WarmServer(key)
        return _SERVERS[key]


def _stream_fd(spec, default_fd: int, mode: str, text: bool, close_after: list):
    """(fd for the child, the parent's end of a pipe or None)."""
    if spec is None:
        return default_fd, None
    if spec == PIPE:
        r, w = os.pipe()
        child, parent = (r, w) if mode == "w" else (w, r)
        close_after.append(child)
        return child, os.fdopen(parent, mode if text else mode + "b")
    if spec == DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        close_after.append(fd)
        return fd, None
    return (spec if isinstance(spec, int) else spec.fileno()), None


def popen(argv: Sequence[str], *, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
          stdin=None, stdout=None, stderr=None, text: bool = False, start_new_session: bool = False,
          preload: Sequence[str] = TORCH) -> WarmProcess:
    """Like subprocess.Popen([sys.executable, *argv], ...), from a warm process that imported
    `preload`. argv: a script path and its arguments, or "-m", a module and its arguments."""
    close_after: list = []
    devnull = os.open(os.devnull, os.O_RDONLY)
    close_after.append(devnull)
    try:
        in_fd, in_pipe = _stream_fd(stdin, devnull, "w", text, close_after)
        out_fd, out_pipe = _stream_fd(stdout, 1, "r", text, close_after)
        if stderr == STDOUT:
            err_fd, err_pipe = out_fd, None
        else:
            err_fd, err_pipe = _stream_fd(stderr, 2, "r", text, close_after)
        server = _server(preload)
        pid = server.start(list(argv), dict(os.environ if env is None else env),
                           os.path.abspath(cwd or os.getcwd()), [in_fd, out_fd, err_fd], start_new_session)
    finally:
        for fd in close_after:
            os.close(fd)
    return WarmProcess(server, pid, [sys.executable, *argv], in_pipe, out_pipe, err_pipe)


def forkserver_context():
    """multiprocessing's "forkserver" context, its server preloaded with FORKSERVER_PRELOAD.

    A Process target then starts as under "spawn" (a new child that imports the target's
    module and unpickles its arguments) without importing torch again; one server per test
    process (multiprocessing keeps one), so every test file asks for the same preload."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # takes effect if this call starts the server
    return ctx
