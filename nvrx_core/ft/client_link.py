"""A rank's link to the node monitor: sends that never block, and a thread that keeps it up.

Training must never wait for the monitor: a monitor that is slow, stopped (SIGSTOP) or gone
must not cost a step anything. So the socket is non-blocking, and nothing is queued
message by message (a queue would have to grow, or drop messages whose order matters):
- a message the socket takes now is sent now (the common case: one send() call);
- a message it cannot take is not kept. The link goes "stale": from then on hot-path calls
  only update the rank's own view (the client keeps it anyway), and once the socket is
  writable again the link's thread sends that whole view as one `state` message: open
  sections with their ages, heartbeat and section-end counts and ages, progress, calculated
  timeouts. The monitor adopts it as is (nvrx_core.ft.watch.apply_state). So heartbeats
  coalesce to the latest one, and section starts and ends are never reordered or lost:
  the state says which sections are open now and since when, which is all the monitor
  enforces. Memory stays bounded: at most the unsent tail of one message.
- The thread also notices the monitor going away (end of stream), connects again (at most
  one attempt per `retry_interval`), registers with the same init, and sends the state, so a
  restarted monitor enforces the same deadlines. It does this even while the training
  thread is stuck (that is when it matters: a hang right after a monitor restart).
"""

import logging
import os
import select
import socket
import threading
import time
from typing import Callable, Dict, Optional

from nvrx_core.ft.protocol import LineBuffer, ProtocolError, decode

logger = logging.getLogger("nvrx.ft.client")

ERROR_WARNINGS = 3
"""Error replies from the monitor logged per link (later ones are counted)."""


def read_reply(sock: socket.socket, timeout: float) -> dict:
    """The first message the monitor sends on a fresh connection (blocking, at most `timeout`)."""
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ConnectionError("no reply from the node monitor")
        sock.settimeout(remaining)
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("node monitor closed the connection during init")
        buf += chunk
    return _first_reply(buf)


def _first_reply(buf: bytes) -> dict:
    try:
        return decode(buf.split(b"\n", 1)[0])
    except ProtocolError as e:
        raise ConnectionError(f"node monitor sent a bad reply: {e}") from None


class MonitorLink:
    """The connection. `lock` is held by the caller around send() (and around its own state
    updates, so a `state` message is always a consistent view); the thread takes it for its
    short, non-blocking writes."""

    def __init__(self, path: str, sock: socket.socket, lock: threading.Lock, init_message: bytes,
                 state_message: Callable[[], bytes], on_registered: Callable[[dict], None],
                 retry_interval: float = 1.0, reply_timeout: float = 10.0,
                 answers: Optional[Dict[str, Callable[[], bytes]]] = None):
        """`answers`: monitor requests this link answers from its own thread (message type ->
        the reply), so they are answered while the training thread is blocked."""
        self.path = path
        self.lock = lock
        self._sock = sock
        sock.setblocking(False)
        self._init = init_message
        self._state_message = state_message
        self._on_registered = on_registered
        self._answers = dict(answers or {})
        self._retry = retry_interval
        self._reply_timeout = reply_timeout
        self._stale = False  # the thread owns the writes until the monitor has the rank's view
        self._resync = False  # a state message is due
        self._pending = b""  # the unsent tail of a message the socket took only part of
        self._lost = False
        self._stop = False
        self._errors = 0
        self.reconnects = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="nvrx-ft-monitor-link", daemon=True)
        self._thread.start()

    # ---- hot path (caller holds self.lock) --------------------------------------
    def send(self, data: bytes) -> None:
        if self._stale:
            self._resync = True
            return
        try:
            sent = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._lost = self._stale = True
            self._wake()
            return
        if sent < len(data):
            self._stale = True
            if sent:
                self._pending = data[sent:]  # the stream must carry the rest of this one first
            else:
                self._resync = True
            self._wake()

    # ---- lifecycle ---------------------------------------------------------------
    def close(self, farewell: Optional[bytes] = None) -> None:
        """Stop the thread; send `farewell` (bye) if the monitor can still take it (within 1 s)."""
        self._stop = True
        self._wake()
        self._thread.join(5.0)
        with self.lock:
            sock, self._sock = self._sock, None
            if sock is not None and farewell is not None and not self._lost:
                try:
                    sock.settimeout(1.0)
                    sock.sendall(self._pending + farewell)
                except OSError:
                    pass
            if sock is not None:
                sock.close()
        if not self._thread.is_alive():  # (a thread still in connect() may yet use them)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except (BlockingIOError, OSError):
            pass  # already woken (pipe full) or closing

    # ---- the thread --------------------------------------------------------------
    def _run(self) -> None:
        replies = LineBuffer()
        while not self._stop:
            if self._lost:
                self._reconnect()
                replies = LineBuffer()
                continue
            sock = self._sock
            want_write = [sock] if self._stale else []
            try:
                readable, writable, _ = select.select([sock, self._wake_r], want_write, [])
            except (OSError, ValueError):
                with self.lock:
                    self._lost = self._stale = True
                continue
            if self._wake_r in readable:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if sock in readable:
                self._on_readable(sock, replies)
            if writable and not self._lost:
                with self.lock:
                    self._flush()

    def _on_readable(self, sock: socket.socket, replies: LineBuffer) -> None:
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            with self.lock:
                self._lost = self._stale = True
            logger.warning("lost the node monitor; reconnecting (hang detection resumes once it is back)")
            return
        for msg, problem in replies.feed(data):
            answer = self._answers.get(msg["t"]) if msg is not None else None
            if answer is not None:
                reply = answer()
                with self.lock:
                    self.send(reply)
                continue
            self._errors += 1
            if self._errors <= ERROR_WARNINGS:
                reason = problem or (msg.get("reason") if msg.get("t") == "error" else f"unexpected {msg['t']}")
                logger.warning("node monitor: %s", reason)

    def _flush(self) -> None:
        """Send the unsent tail, then the state (lock held; never blocks)."""
        try:
            while self._pending or self._resync:
                if not self._pending:
                    self._pending, self._resync = self._state_message(), False
                sent = self._sock.send(self._pending)
                self._pending = self._pending[sent:]
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._lost = True
            return
        self._stale = False

    def _reconnect(self) -> None:
        with self.lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._pending = b""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._retry)
            sock.connect(self.path)  # (lands in the listen backlog while a new monitor starts)
            sock.sendall(self._init)
            reply = self._await_reply(sock)
            if reply["t"] != "init_ok":
                raise ConnectionError(f"node monitor refused this rank: {reply.get('reason')}")
            sock.setblocking(False)
            self._on_registered(reply)
        except (OSError, ConnectionError) as e:
            sock.close()
            logger.debug("reconnecting to the node monitor failed: %s", e)
            self._sleep(self._retry)
            return
        with self.lock:
            self._sock = sock
            self._lost, self._stale, self._resync = False, True, True
        self.reconnects += 1
        logger.warning("re-registered with the node monitor; hang detection is active again")

    def _await_reply(self, sock: socket.socket) -> dict:
        """The monitor's answer to init, waiting at most reply_timeout, and no longer once close()
        was called (so a rank's exit never waits on a monitor that is not there)."""
        buf = b""
        deadline = time.monotonic() + self._reply_timeout
        while b"\n" not in buf:
            remaining = deadline - time.monotonic()
            if self._stop or remaining <= 0:
                raise ConnectionError("no reply from the node monitor")
            readable, _, _ = select.select([sock, self._wake_r], [], [], remaining)
            if self._wake_r in readable:
                os.read(self._wake_r, 4096)
            if sock in readable:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("node monitor closed the connection during init")
                buf += chunk
        return _first_reply(buf)

    def _sleep(self, seconds: float) -> None:
        """Wait, but wake at once for close()."""
        try:
            select.select([self._wake_r], [], [], seconds)
            os.read(self._wake_r, 4096)
        except (BlockingIOError, OSError, ValueError):
            pass
