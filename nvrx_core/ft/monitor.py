"""The node monitor: one process per node that watches every local rank for hangs.

It outlives restart cycles (started once by ft_launcher) so calculated timeouts and the
per-cycle progress record survive the ranks. Ranks talk to it over a Unix socket
(nvrx_core.ft.protocol). It sleeps until the earliest deadline of any rank; when one
expires it dumps the rank's stacks and kills it (nvrx_core.ft.kills). The launcher then
sees a failed worker and restarts the group. Timing never blocks serving: pending kills
are scheduled actions, and replies are queued (nvrx_core.ft.monitor_io). What a rank's
message means for its record is nvrx_core.ft.rank_messages.

If it dies anyway, ft_launcher starts a new one on the same listening socket, passing the
restart cycle and the ranks still running (--adopt): each must re-register within a grace
(its client reconnects on its own and re-sends its state), or it is treated as hung.

Trust: a peer is known by SO_PEERCRED (no credentials, no connection); a rank can only
register as its own pid, whose pidfd the monitor then holds for every signal; control
messages (cycle, stats, stop) are accepted from the launcher's pid only.

Stop signals sent to the whole job (Slurm's --signal reaches every process of the step) are
ignored: the ranks may be saving a checkpoint, and their timeouts still hold. The launcher
ends the monitor with a "stop" request (then SIGKILL), or the monitor notices it is gone.

Imports stdlib only (plus nvrx_core config parsing): it must start fast and never touch torch.
"""

import argparse
import json
import logging
import os
import selectors
import socket
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

from nvrx_core import events as ev
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.kills import Killer, Scheduler, SendSignal, signal_by_handle
from nvrx_core.ft.hang_evidence import HangEvidence
from nvrx_core.ft.monitor_io import Conn, dump_size, peer_credentials, read_stacks, remove, report_stacks, stack_file
from nvrx_core.ft.protocol import ProtocolError, encode
from nvrx_core.ft.rank_messages import WATCH_MESSAGES, apply_to_watch
from nvrx_core.ft.timeouts import Timeouts
from nvrx_core.ft.watch import RankWatch, cycle_stats, next_deadline, parse_adopt, reregister_grace
from nvrx_core.proc import ProcessHandle
from nvrx_core.signals import ignore_stop_requests

__all__ = ["NodeMonitor", "RankWatch", "next_deadline", "main"]

logger = logging.getLogger("nvrx.ft.monitor")

CONTROL_MESSAGES = frozenset({"cycle", "stats", "stop"})
REREGISTER_FLOOR = 30.0
"""Seconds an adopted rank has at least to re-register with a restarted monitor."""
_DRAIN_PASSES = 8  # bounded: a peer flooding the socket must not keep enforcement away


class NodeMonitor:
    """Serves ranks and the launcher on a listening Unix socket; enforces deadlines."""

    def __init__(
        self,
        listener: socket.socket,
        config: FTConfig,
        events: ev.EventLog,
        clock: Callable[[], float] = time.monotonic,
        send_signal: SendSignal = signal_by_handle,
        launcher_pid: Optional[int] = None,
        credentials: Callable[[socket.socket], Tuple[int, int, int]] = peer_credentials,
        open_process: Callable[[int], ProcessHandle] = ProcessHandle.open,
        cycle: int = 0,
        adopt: Optional[Dict[int, ProcessHandle]] = None,
        reregister_floor: float = REREGISTER_FLOOR,
    ):
        """`launcher_pid`: the only peer whose control messages are accepted (None: nobody's),
        and the parent whose exit ends serve_forever(). `send_signal`, `credentials` and
        `open_process` are injectable so tests can stand in for the kernel."""
        self.cfg = config
        self.events = events
        self._clock = clock
        self._launcher_pid = launcher_pid
        self._credentials = credentials
        self._open_process = open_process
        self._listener = listener
        listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, None)
        self._conns: Dict[int, Conn] = {}
        self._sched = Scheduler(clock)
        self._evidence = HangEvidence(
            events, clock, ask=self._ask_collectives, dump=lambda w: send_signal(w, config.stack_dump_signal),
            read_stacks=lambda w: read_stacks(self._stack_file(w)), schedule=self._sched.at,
            stacks_after=config.stack_dump_grace)
        self._killer = Killer(config, events, self._sched, clock, send_signal, self._report_stacks,
                              awaiting_evidence=self._evidence.awaiting_answers,
                              dump_size=lambda w: dump_size(self._stack_file(w)))
        self.cycle = cycle
        self.stop_requested = False  # by the launcher: serve_forever() returns
        self._cycle_watches: List[RankWatch] = []
        self._cycle_progressed = False
        self._warned_bare_pid = False
        self._adopted: Dict[int, RankWatch] = {}  # pid -> watch of a rank that must re-register
        if adopt:
            self._adopt(adopt, reregister_grace(Timeouts.from_config(config), reregister_floor))

    # ---- main loop -------------------------------------------------------------
    def serve_forever(self) -> None:
        try:
            while not self.stop_requested:
                self.poll(self.cfg.workload_check_interval)
                if self._launcher_pid is not None and os.getppid() != self._launcher_pid:
                    logger.info("launcher (pid %d) is gone; monitor exiting", self._launcher_pid)
                    break
        finally:
            self.close()

    def poll(self, max_wait: float) -> None:
        """Serve I/O for at most `max_wait` seconds (less if a deadline comes first), then enforce."""
        now = self._clock()
        wake = now + max_wait
        for when in (self._nearest_deadline(), self._sched.next_time()):
            if when is not None:
                wake = min(wake, when)
        self._serve(self._sel.select(max(0.0, wake - now)))
        self._sched.run_due()
        self._enforce()

    def _serve(self, ready) -> None:
        for key, mask in ready:
            if key.data is None:
                self._accept()
                continue
            conn = key.data
            if mask & selectors.EVENT_WRITE and not conn.flush():
                self._drop(conn, clean=False)
                continue
            if mask & selectors.EVENT_READ:
                self._read(conn)
            self._watch_writes(conn)

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn, clean=True)
        for w in self._adopted.values():
            w.proc.close()
        self._adopted.clear()
        self._sel.close()
        self._listener.close()

    # ---- connections -----------------------------------------------------------
    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            pid = self._credentials(sock)[0]
            if pid <= 0:
                raise OSError(f"the kernel reports pid {pid}")
            proc = self._open_process(pid)
        except OSError as e:  # fail closed: an unknown peer is no peer
            logger.warning("dropped a connection whose peer cannot be identified: %s", e)
            sock.close()
            return
        if not proc.by_pidfd and not self._warned_bare_pid:
            self._warned_bare_pid = True
            logger.warning("this kernel has no pidfds: ranks are signalled by pid, and only while connected")
        sock.setblocking(False)
        conn = Conn(sock=sock, peer_pid=pid, proc=proc)
        self._conns[sock.fileno()] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: Conn) -> None:
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
            if conn.sock.fileno() < 0:  # dropped by an earlier message (bye, a reply never read)
                return
            if problem is not None:
                conn.warn_bad(problem)
                continue
            try:
                self._handle(conn, msg)
            except (ProtocolError, ValueError) as e:
                conn.warn_bad(f"{msg.get('t')!r} message: {e}")
                self._reply(conn, encode("error", reason=str(e)[:1000]), droppable=True)

    def _reply(self, conn: Conn, data: bytes, droppable: bool = False) -> None:
        if not conn.queue(data, droppable):
            self._drop(conn, clean=False)

    def _watch_writes(self, conn: Conn) -> None:
        """Wake for writability only while replies are queued."""
        if conn.sock.fileno() < 0:
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        if self._sel.get_key(conn.sock).events != events:
            self._sel.modify(conn.sock, events, conn)

    def _drop(self, conn: Conn, clean: bool) -> None:
        if self._conns.pop(conn.sock.fileno(), None) is None:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        conn.report_bad()
        w = conn.watch
        conn.watch = None
        if w is None:
            conn.proc.close()
            return
        if not clean and not w.expired:
            logger.info("rank %d (pid %d) disconnected without saying bye", w.rank, w.pid)
            self.events.emit(ev.RANK_DISCONNECTED, rank=w.rank, cycle=w.cycle, pid=w.pid)
        if not w.expired:  # an expired rank's stacks are reported, then removed
            remove(self._stack_file(w))
        self._killer.rank_disconnected(w)  # closes the pidfd unless a kill step still needs it

    def _stack_file(self, w: RankWatch) -> str:
        return stack_file(os.path.dirname(self._listener.getsockname()) or ".", w)

    def _report_stacks(self, w: RankWatch) -> None:
        self._evidence.report_stacks(w, report_stacks(self._stack_file(w), w))

    def _ask_collectives(self, w: RankWatch) -> bool:
        conn = next((c for c in self._conns.values() if c.watch is w), None)
        if conn is None:
            return False
        self._reply(conn, encode("dump_collectives"), droppable=True)
        return True

    # ---- messages --------------------------------------------------------------
    def _handle(self, conn: Conn, msg: dict) -> None:
        kind = msg["t"]
        now = self._clock()
        if kind in CONTROL_MESSAGES:
            self._on_control(conn, msg)
            return
        if kind == "init":
            self._on_init(conn, msg, now)
            return
        w = conn.watch
        if w is None:
            raise ProtocolError(f"{kind} before init")
        if kind in ("hb", "se", "progress") and not self._cycle_progressed:
            self._progressed(w, kind)
        if kind in WATCH_MESSAGES:
            apply_to_watch(w, msg, now, self.cfg, self.events)
            if kind == "state" and not self._cycle_progressed and (
                    w.heartbeats or w.section_ends or w.max_iteration is not None):
                self._progressed(w, kind)
        elif kind == "collectives":
            self._evidence.answered(w, msg)
        elif kind == "bye":
            self._drop(conn, clean=True)
        else:
            raise ProtocolError(f"{kind} is not a rank message")

    def _progressed(self, w: RankWatch, signal_kind: str) -> None:
        self._cycle_progressed = True
        self.events.emit(ev.FIRST_PROGRESS, rank=w.rank, cycle=w.cycle, signal=signal_kind)

    def _on_control(self, conn: Conn, msg: dict) -> None:
        if self._launcher_pid is None or conn.peer_pid != self._launcher_pid:
            raise ProtocolError(f"{msg['t']} is a launcher message; refused from pid {conn.peer_pid}")
        if msg["t"] == "cycle":
            self.cycle, self._cycle_watches, self._cycle_progressed = msg["cycle"], [], False
            self._reply(conn, encode("ok"))
        elif msg["t"] == "stop":
            self.stop_requested = True
            self._reply(conn, encode("ok"))
        else:
            self._reply(conn, encode("stats_reply", stats=self.cycle_stats()))

    def _on_init(self, conn: Conn, msg: dict, now: float) -> None:
        if msg["pid"] != conn.peer_pid:
            raise ProtocolError(f"init claims pid {msg['pid']} but the socket peer is pid {conn.peer_pid}")
        if conn.watch is not None:
            raise ProtocolError("init twice on one connection")
        w = RankWatch(
            rank=msg["rank"], local_rank=msg["local_rank"], pid=msg["pid"], cycle=msg["cycle"],
            connected_at=now, timeouts=Timeouts.from_config(self.cfg), proc=conn.proc,
        )
        conn.watch = w
        adopted = self._adopted.pop(w.pid, None)
        if adopted is not None:
            if not adopted.expired:  # (an expired one's kill steps still hold its pidfd)
                adopted.proc.close()
            logger.info("rank %d (pid %d) re-registered", w.rank, w.pid)
        # a rank reconnecting to this same monitor replaces its earlier record (its state follows)
        self._cycle_watches = [old for old in self._cycle_watches if old.pid != w.pid]
        self._cycle_watches.append(w)
        self._reply(conn, encode("init_ok", config=self.cfg.to_json(), timeouts=w.timeouts.to_json(),
                                 stack_file=self._stack_file(w)))

    def _adopt(self, ranks: Dict[int, ProcessHandle], grace: float) -> None:
        """Watch ranks of the monitor this one replaces until they re-register (see module doc)."""
        now = self._clock()
        for rank, proc in ranks.items():
            if proc.exited():
                proc.close()
                continue  # already gone: the launcher sees it
            self._adopted[proc.pid] = RankWatch(
                rank=rank, local_rank=-1, pid=proc.pid, cycle=self.cycle, connected_at=now, timeouts=Timeouts(),
                proc=proc, reregister_by=now + grace, connected=False)
        if self._adopted:
            logger.info("waiting up to %.0f s for ranks %s to re-register", grace,
                        sorted(w.rank for w in self._adopted.values()))

    def cycle_stats(self) -> dict:
        """What the ranks of the current cycle did (watch.cycle_stats): the launcher reads it."""
        return cycle_stats(self.cycle, self._cycle_watches, list(self._adopted.values()))

    # ---- enforcement -----------------------------------------------------------
    def _watches(self):
        live = [c.watch for c in self._conns.values() if c.watch is not None and not c.watch.expired]
        return live + [w for w in self._adopted.values() if not w.expired]

    def _nearest_deadline(self) -> Optional[float]:
        deadlines = [d[0] for d in map(next_deadline, self._watches()) if d is not None]
        return min(deadlines) if deadlines else None

    def _enforce(self) -> None:
        now = self._clock()
        if any(d is not None and d[0] <= now for d in map(next_deadline, self._watches())):
            # Read everything that has arrived before calling anyone hung. A wait cut short by
            # SIGSTOP / SIGCONT reports no events when its timeout passed meanwhile (Python
            # retries an interrupted wait only while time is left), though the ranks' messages
            # of the whole stopped spell are waiting to be read.
            for _ in range(_DRAIN_PASSES):
                ready = self._sel.select(0)
                if not ready:
                    break
                self._serve(ready)
            now = self._clock()
        for w in self._watches():
            due = next_deadline(w)
            if due is None or due[0] > now:
                continue
            if w.reregister_by is not None and w.proc.exited():
                self._adopted.pop(w.pid, None)  # exited meanwhile: nothing to watch
                w.proc.close()
                continue
            self._evidence.hang_detected(w, self._watches())
            self._killer.begin(w, due[1], overdue=now - due[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="nvrx-suite node monitor (started by ft_launcher)")
    parser.add_argument("--fd", type=int, required=True, help="inherited listening Unix socket")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--events-file", default=None)
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="the launcher: the only sender of control messages; the monitor exits with it")
    parser.add_argument("--cycle", type=int, default=0, help="the current restart cycle (a restarted monitor)")
    parser.add_argument("--adopt", default="", metavar="RANK:PID,...",
                        help="ranks of a monitor that died: each must re-register, or is treated as hung")
    args = parser.parse_args(argv)
    cfg = FTConfig.from_json(json.loads(args.config_json))
    try:
        adopt = {rank: ProcessHandle(pid, pidfd) for rank, (pid, pidfd) in parse_adopt(args.adopt).items()}
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=cfg.log_level, stream=sys.stderr,
                        format="[nvrx monitor %(asctime)s] %(levelname)s %(message)s")
    # A stop signal to the whole job (Slurm's --signal) must not end the watch while the ranks
    # save: the launcher decides when the monitor stops (a "stop" request), or its exit does.
    claims = ignore_stop_requests("node monitor")
    try:
        NodeMonitor(socket.socket(fileno=args.fd), cfg, ev.EventLog(args.events_file, source="monitor"),
                    launcher_pid=args.parent_pid, cycle=args.cycle, adopt=adopt).serve_forever()
    finally:
        for claim in claims:
            claim.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
