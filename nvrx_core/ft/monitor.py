"""The node monitor: one process per node that watches every local rank for hangs.

It outlives restart cycles (started once by ft_launcher) so calculated timeouts and the
per-cycle progress record survive the ranks. Ranks talk to it over a Unix socket
(nvrx_core.ft.protocol). It sleeps until the earliest deadline of any rank; when one
expires it asks the rank to dump all thread stacks (faulthandler on stack_dump_signal, into
a per-rank file the monitor then prints as one block), waits stack_dump_grace (longer while
the signal is still pending: a rank the scheduler has not run yet has not written its
stacks), sends rank_termination_signal, and escalates to SIGKILL if the rank is still alive
after termination_grace. The launcher then sees a failed worker and restarts the group.
Timing never blocks serving: pending kills are scheduled actions.

Imports stdlib only (plus nvrx_core config parsing): it must start fast and never touch torch.
"""

import argparse
import dataclasses
import heapq
import json
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

from nvrx_core import events as ev
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.protocol import LineBuffer, ProtocolError, encode
from nvrx_core.ft.timeouts import Timeouts
from nvrx_core.proc import DUMP_WAIT_LIMIT, signal_pending

logger = logging.getLogger("nvrx.ft.monitor")

_PEERCRED = struct.Struct("3i")


@dataclasses.dataclass
class RankWatch:
    """What the monitor knows about one connected rank."""

    rank: int
    local_rank: int
    pid: int
    cycle: int
    connected_at: float
    timeouts: Timeouts
    last_heartbeat: Optional[float] = None
    heartbeats: int = 0
    open_sections: Dict[str, float] = dataclasses.field(default_factory=dict)
    uses_sections: bool = False
    last_section_end: Optional[float] = None
    section_ends: int = 0
    max_iteration: Optional[int] = None
    expired: bool = False


def next_deadline(w: RankWatch) -> Optional[Tuple[float, str]]:
    """The earliest moment `w` counts as hung, and why; None if nothing is enforced.

    Heartbeat deadlines apply unless the rank chose section mode (opened a section and
    never sent a heartbeat). Section deadlines apply to each open section; with none open,
    the out-of-section timeout runs from the last section end (or the connection).
    """
    t = w.timeouts
    candidates: List[Tuple[float, str]] = []
    if w.last_heartbeat is None:
        if t.initial_heartbeat is not None and not w.uses_sections:
            candidates.append((w.connected_at + t.initial_heartbeat, "no initial heartbeat"))
    elif t.heartbeat is not None:
        candidates.append((w.last_heartbeat + t.heartbeat, "heartbeat timeout"))
    if w.open_sections:
        for name, started in w.open_sections.items():
            limit = t.sections.get(name)
            if limit is not None:
                candidates.append((started + limit, f"section '{name}' timeout"))
    elif t.out_of_section is not None:
        since = w.last_section_end if w.last_section_end is not None else w.connected_at
        candidates.append((since + t.out_of_section, "out-of-section timeout"))
    return min(candidates) if candidates else None


@dataclasses.dataclass
class _Conn:
    sock: socket.socket
    peer_pid: int
    buffer: LineBuffer = dataclasses.field(default_factory=LineBuffer)
    watch: Optional[RankWatch] = None


class NodeMonitor:
    """Serves ranks and the launcher on a listening Unix socket; enforces deadlines."""

    def __init__(
        self,
        listener: socket.socket,
        config: FTConfig,
        events: ev.EventLog,
        clock: Callable[[], float] = time.monotonic,
        kill: Callable[[int, int], None] = os.kill,
        parent_pid: Optional[int] = None,
    ):
        self.cfg = config
        self.events = events
        self._clock = clock
        self._kill = kill
        self._parent_pid = parent_pid
        self._listener = listener
        listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, None)
        self._conns: Dict[int, _Conn] = {}
        self._actions: List[Tuple[float, int, Callable[[], None]]] = []  # heap of scheduled kills
        self._seq = 0
        self.cycle = 0
        self._cycle_watches: List[RankWatch] = []
        self._cycle_progressed = False

    # ---- main loop -------------------------------------------------------------
    def serve_forever(self) -> None:
        try:
            while True:
                self.poll(self.cfg.workload_check_interval)
                if self._parent_pid is not None and os.getppid() != self._parent_pid:
                    logger.info("launcher (pid %d) is gone; monitor exiting", self._parent_pid)
                    break
        finally:
            self.close()

    def poll(self, max_wait: float) -> None:
        """Serve I/O for at most `max_wait` seconds (less if a deadline comes first), then enforce."""
        now = self._clock()
        wake = now + max_wait
        nearest = self._nearest_deadline()
        if nearest is not None:
            wake = min(wake, nearest)
        if self._actions:
            wake = min(wake, self._actions[0][0])
        for key, _ in self._sel.select(max(0.0, wake - now)):
            if key.data is None:
                self._accept()
            else:
                self._read(key.data)
        self._run_due_actions()
        self._enforce()

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn, clean=True)
        self._sel.close()
        self._listener.close()

    # ---- connections -----------------------------------------------------------
    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        try:
            pid, _, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            pid = -1
        conn = _Conn(sock=sock, peer_pid=pid)
        self._conns[sock.fileno()] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn, clean=False)
            return
        for msg, problem in conn.buffer.feed(data):
            if problem is not None:
                logger.warning("dropped a bad message from pid %d: %s", conn.peer_pid, problem)
                continue
            try:
                self._handle(conn, msg)
            except (ProtocolError, ValueError) as e:
                logger.warning("dropped a bad %r message from pid %d: %s", msg.get("t"), conn.peer_pid, e)
                self._reply(conn, encode("error", reason=str(e)))

    def _drop(self, conn: _Conn, clean: bool) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        w = conn.watch
        if w is not None and not clean and not w.expired:
            logger.info("rank %d (pid %d) disconnected without saying bye", w.rank, w.pid)
        if w is not None and not w.expired:  # an expired rank's stacks are reported, then removed
            _remove(self._stack_file(w))
        conn.watch = None

    def _stack_file(self, w: RankWatch) -> str:
        """Where the rank's faulthandler writes (the client opens it): one file per rank, so the
        stacks of ranks dumped at the same moment are not interleaved in one output stream."""
        directory = os.path.dirname(self._listener.getsockname()) or "."
        return os.path.join(directory, f"stacks-rank{w.rank}-pid{w.pid}.txt")

    def _report_stacks(self, w: RankWatch) -> None:
        """Log the rank's dump as one block, then remove the file."""
        path = self._stack_file(w)
        try:
            with open(path, errors="replace") as f:
                dump = f.read(MAX_STACK_DUMP_CHARS)
        except OSError:
            return
        _remove(path)
        if dump.strip():
            logger.error("stacks of hung rank %d (pid %d):\n%s", w.rank, w.pid, dump.rstrip())

    def _reply(self, conn: _Conn, data: bytes) -> None:
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(1.0)
            conn.sock.sendall(data)
        except OSError as e:
            logger.warning("could not reply to pid %d: %s", conn.peer_pid, e)
        finally:
            try:
                conn.sock.setblocking(False)
            except OSError:
                pass

    # ---- messages --------------------------------------------------------------
    def _handle(self, conn: _Conn, msg: dict) -> None:
        kind = msg["t"]
        now = self._clock()
        if kind == "init":
            self._on_init(conn, msg, now)
            return
        if kind == "cycle":
            self.cycle = msg["cycle"]
            self._cycle_watches = []
            self._cycle_progressed = False
            self._reply(conn, encode("ok"))
            return
        if kind == "stats":
            self._reply(conn, encode("stats_reply", stats=self.cycle_stats()))
            return
        w = conn.watch
        if w is None:
            raise ProtocolError(f"{kind} before init")
        if kind in ("hb", "se", "progress") and not self._cycle_progressed:
            self._cycle_progressed = True
            self.events.emit(ev.FIRST_PROGRESS, rank=w.rank, cycle=w.cycle, signal=kind)
        if kind == "hb":
            w.last_heartbeat = now
            w.heartbeats += 1
        elif kind == "ss":
            w.uses_sections = True
            w.open_sections[msg["name"]] = now
        elif kind == "se":
            if w.open_sections.pop(msg["name"], None) is not None:
                w.section_ends += 1
                if not w.open_sections:
                    w.last_section_end = now
        elif kind == "sea":
            if w.open_sections:
                w.open_sections.clear()
                w.section_ends += 1
                w.last_section_end = now
        elif kind == "progress":
            w.max_iteration = max(msg["iteration"], w.max_iteration if w.max_iteration is not None else -1)
        elif kind == "timeouts":
            calculated = Timeouts.from_json(msg["timeouts"], source="timeouts message")
            w.timeouts = w.timeouts.overridden_by(calculated)
            self.events.emit(ev.TIMEOUTS_UPDATED, rank=w.rank, cycle=w.cycle, timeouts=w.timeouts.to_json())
        elif kind == "bye":
            self._drop(conn, clean=True)
        else:
            raise ProtocolError(f"{kind} is not a rank message")

    def _on_init(self, conn: _Conn, msg: dict, now: float) -> None:
        if conn.peer_pid > 0 and msg["pid"] != conn.peer_pid:
            raise ProtocolError(f"init claims pid {msg['pid']} but the socket peer is pid {conn.peer_pid}")
        w = RankWatch(
            rank=msg["rank"], local_rank=msg["local_rank"], pid=msg["pid"], cycle=msg["cycle"],
            connected_at=now, timeouts=Timeouts.from_config(self.cfg),
        )
        conn.watch = w
        self._cycle_watches.append(w)
        self._reply(conn, encode("init_ok", config=self.cfg.to_json(), timeouts=w.timeouts.to_json(),
                                 stack_file=self._stack_file(w)))

    def cycle_stats(self) -> dict:
        """Progress made by the ranks of the current cycle (the launcher's no-progress check)."""
        iterations = [w.max_iteration for w in self._cycle_watches if w.max_iteration is not None]
        return {
            "cycle": self.cycle,
            "ranks": len(self._cycle_watches),
            "heartbeats": sum(w.heartbeats for w in self._cycle_watches),
            "section_ends": sum(w.section_ends for w in self._cycle_watches),
            "max_iteration": max(iterations) if iterations else None,
        }

    # ---- enforcement -----------------------------------------------------------
    def _watches(self):
        return [c.watch for c in self._conns.values() if c.watch is not None and not c.watch.expired]

    def _nearest_deadline(self) -> Optional[float]:
        deadlines = [d[0] for d in map(next_deadline, self._watches()) if d is not None]
        return min(deadlines) if deadlines else None

    def _enforce(self) -> None:
        now = self._clock()
        for w in self._watches():
            due = next_deadline(w)
            if due is not None and due[0] <= now:
                self._begin_kill(w, due[1], overdue=now - due[0])

    def _schedule(self, at: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._actions, (at, self._seq, action))

    def _run_due_actions(self) -> None:
        while self._actions and self._actions[0][0] <= self._clock():
            _, _, action = heapq.heappop(self._actions)
            action()

    def _signal(self, w: RankWatch, sig: int) -> bool:
        try:
            self._kill(w.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def _begin_kill(self, w: RankWatch, reason: str, overdue: float) -> None:
        w.expired = True
        logger.error("rank %d (pid %d) hung: %s; dumping its stacks, then terminating it", w.rank, w.pid, reason)
        self.events.emit(
            ev.FAULT_DETECTED, rank=w.rank, cycle=w.cycle, fault="hang", reason=reason,
            pid=w.pid, open_sections=sorted(w.open_sections), overdue_s=round(overdue, 3),
        )
        if self._signal(w, self.cfg.stack_dump_signal):
            self.events.emit(ev.STACKS_DUMPED, rank=w.rank, cycle=w.cycle, pid=w.pid,
                             signal=self.cfg.stack_dump_signal.name)
        sent = self._clock()
        self._schedule(sent + self.cfg.stack_dump_grace, lambda: self._terminate_after_dump(w, sent, waited=False))

    def _terminate_after_dump(self, w: RankWatch, sent: float, waited: bool) -> None:
        """Terminate once the rank has taken the dump signal, or after DUMP_WAIT_LIMIT."""
        now = self._clock()
        if now - sent < DUMP_WAIT_LIMIT and signal_pending(w.pid, self.cfg.stack_dump_signal):
            self._schedule(now + 0.05, lambda: self._terminate_after_dump(w, sent, waited=True))
        elif waited and now - sent < DUMP_WAIT_LIMIT:  # taken late: give it the grace to write
            self._schedule(now + self.cfg.stack_dump_grace, lambda: self._terminate_after_dump(w, sent, False))
        else:
            self._report_stacks(w)
            self._terminate(w)

    def _terminate(self, w: RankWatch) -> None:
        sig = self.cfg.rank_termination_signal
        if not self._signal(w, sig):
            return
        self._signal(w, signal.SIGCONT)  # a stopped (SIGSTOP) rank must run to act on SIGTERM
        self.events.emit(ev.RANK_KILLED, rank=w.rank, cycle=w.cycle, pid=w.pid, signal=sig.name)
        if sig != signal.SIGKILL:
            self._schedule(self._clock() + self.cfg.termination_grace, lambda: self._escalate(w))

    def _escalate(self, w: RankWatch) -> None:
        if self._signal(w, signal.SIGKILL):
            logger.error("rank %d (pid %d) survived %s; sent SIGKILL", w.rank, w.pid,
                         self.cfg.rank_termination_signal.name)


MAX_STACK_DUMP_CHARS = 1 << 20


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="nvrx-suite node monitor (started by ft_launcher)")
    parser.add_argument("--fd", type=int, required=True, help="inherited listening Unix socket")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--events-file", default=None)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    cfg = FTConfig.from_json(json.loads(args.config_json))
    logging.basicConfig(level=cfg.log_level, stream=sys.stderr,
                        format="[nvrx monitor %(asctime)s] %(levelname)s %(message)s")
    listener = socket.socket(fileno=args.fd)
    monitor = NodeMonitor(listener, cfg, ev.EventLog(args.events_file, source="monitor"),
                          parent_pid=args.parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop
    monitor.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
