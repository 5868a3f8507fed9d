"""The node monitor's side of one socket connection: who the peer is, and replies that never block.

- The peer is known by SO_PEERCRED, read once at accept. Where it cannot be read the
  connection is dropped (fails closed): a peer whose pid is unknown cannot be checked
  against what it claims, and there would be no process to hold for a kill.
- Replies go to a per-connection queue, written as the socket takes them (the selector
  watches for writability while the queue is not empty). A peer that does not read (stopped,
  slow, hostile) costs the monitor memory up to a cap, never time: past REPLY_QUEUE_CAP
  error replies are dropped, and past REPLY_QUEUE_LIMIT the connection is dropped.
- Warnings about bad messages are rate-limited per connection: a vandal flooding garbage
  must not flood the log (or the disk it goes to).
And the file through which a rank hands the monitor its stack dump.
"""

import dataclasses
import logging
import os
import socket
import struct
from typing import Optional, Tuple

from nvrx_core.ft.protocol import LineBuffer
from nvrx_core.ft.watch import RankWatch
from nvrx_core.proc import ProcessHandle

logger = logging.getLogger("nvrx.ft.monitor")

_PEERCRED = struct.Struct("3i")

REPLY_QUEUE_CAP = 64 * 1024
"""Queued reply bytes above which error replies (advisory) are dropped."""
REPLY_QUEUE_LIMIT = 1024 * 1024
"""Queued reply bytes above which the peer is taken as not reading and disconnected."""
MAX_STACK_DUMP_CHARS = 1 << 20
BAD_MESSAGE_WARNINGS = 3
"""Bad messages logged per connection; later ones are only counted (reported at disconnect)."""


def peer_credentials(sock: socket.socket) -> Tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected `sock`; OSError if the kernel will not say."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))


@dataclasses.dataclass
class Conn:
    sock: socket.socket
    peer_pid: int
    proc: Optional[ProcessHandle] = None
    buffer: LineBuffer = dataclasses.field(default_factory=LineBuffer)
    watch: Optional[RankWatch] = None
    out: bytearray = dataclasses.field(default_factory=bytearray)
    bad_messages: int = 0

    def queue(self, data: bytes, droppable: bool) -> bool:
        """Queue `data` and write what the socket takes now. False: the peer must be dropped."""
        if droppable and len(self.out) >= REPLY_QUEUE_CAP:
            return True
        self.out += data
        if len(self.out) > REPLY_QUEUE_LIMIT:
            logger.warning("pid %d does not read its replies (%d bytes queued); dropping it",
                           self.peer_pid, len(self.out))
            return False
        return self.flush()

    def flush(self) -> bool:
        """Write queued replies without blocking. False: the connection is broken."""
        while self.out:
            try:
                sent = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                logger.info("could not reply to pid %d: %s", self.peer_pid, e)
                return False
            del self.out[:sent]
        return True

    def warn_bad(self, what: str) -> None:
        self.bad_messages += 1
        if self.bad_messages <= BAD_MESSAGE_WARNINGS:
            logger.warning("dropped a bad message from pid %d: %s", self.peer_pid, what)
        if self.bad_messages == BAD_MESSAGE_WARNINGS:
            logger.warning("further bad messages from pid %d are counted, not logged", self.peer_pid)

    def report_bad(self) -> None:
        if self.bad_messages > BAD_MESSAGE_WARNINGS:
            logger.warning("pid %d sent %d bad messages in all", self.peer_pid, self.bad_messages)


def stack_file(directory: str, w: RankWatch) -> str:
    """Where the rank's faulthandler writes (the client opens it): one file per rank, so the
    stacks of ranks dumped at the same moment are not interleaved in one output stream."""
    return os.path.join(directory, f"stacks-rank{w.rank}-pid{w.pid}.txt")


def read_stacks(path: str) -> str:
    """The rank's dump so far ("" when it wrote none)."""
    try:
        with open(path, errors="replace") as f:
            return f.read(MAX_STACK_DUMP_CHARS)
    except OSError:
        return ""


def dump_size(path: str) -> Optional[int]:
    """The size of the rank's dump file so far (None: there is none)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def report_stacks(path: str, w: RankWatch) -> str:
    """Log the rank's dump as one block, remove the file, and return the dump."""
    dump = read_stacks(path)
    remove(path)
    if dump.strip():
        logger.error("stacks of hung rank %d (pid %d):\n%s", w.rank, w.pid, dump.rstrip())
    return dump


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
