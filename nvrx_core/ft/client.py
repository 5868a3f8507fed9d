"""RankMonitorClient: the rank's side of hang detection.

The hot-path calls (send_heartbeat, start_section, end_section) write one pre-encoded
line to the node monitor's socket and never wait for an answer, nor for the socket: a
monitor that is slow, stopped or restarting costs a step nothing (nvrx_core.ft.client_link
says how nothing is lost meanwhile). A clock read feeds the interval observer used by
calculate_and_set_timeouts(), and the client keeps its own view of what the monitor
enforces (open sections, last heartbeat, progress), which it re-sends whole after a
reconnect or a spell the socket could not take messages. Run outside ft_launcher the
client says loudly that monitoring is inactive and turns every call into a no-op, so the
same script still runs under torchrun or plain python (torchrun silently dropping fault
tolerance is a trap this avoids).
"""

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from typing import IO, Callable, Dict, Iterable, Iterator, Optional

from nvrx_core import dist_env
from nvrx_core import events as ev
from nvrx_core.config import ConfigError
from nvrx_core.durable import atomic_write_json
from nvrx_core.ft.client_link import MonitorLink, read_reply
from nvrx_core.ft.collective_trace import collectives_message
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.nvrx_names import (NVRX_STATE_KEY, MonitorUnreachable, NVRxClientNames, RankMonitorClientError,
                                     state_from_nvrx)
from nvrx_core.ft.protocol import encode
from nvrx_core.ft.timeouts import IntervalObserver, Timeouts, scale
from nvrx_core.ft.uncaught import UncaughtExceptionRecorder
from nvrx_core.signals import FaultHandlerDump, SignalClaim, default_registry, parse_signal

STACK_DUMP_OWNER = "ft.client"
logger = logging.getLogger("nvrx.ft.client")

MONITOR_SOCKET_ENV = "NVRX_FT_MONITOR_SOCKET"
STATE_FILE_NAME = "ft_state.json"
STATE_VERSION = 1

_HEARTBEAT = encode("hb")
_END_ALL = encode("sea")


class RankMonitorClient(NVRxClientNames):
    """Connects one rank to the node monitor started by ft_launcher (nvidia-resiliency-ext's
    names for the same state come from NVRxClientNames)."""

    def __init__(self, socket_path: Optional[str] = None, clock: Callable[[], float] = time.monotonic):
        self._path = socket_path if socket_path is not None else os.environ.get(MONITOR_SOCKET_ENV)
        self._clock = clock
        self._link: Optional[MonitorLink] = None
        self._lock = threading.Lock()
        self._observer: Optional[IntervalObserver] = None
        # the rank's own view of what the monitor enforces (re-sent whole as a `state` message)
        self._registered_at = 0.0
        self._heartbeats = 0
        self._last_heartbeat: Optional[float] = None
        self._sections_used = False
        self._section_ends = 0
        self._last_section_end: Optional[float] = None
        self._iteration: Optional[int] = None
        self._section_msgs: Dict[str, tuple] = {}
        self._section_names: tuple = ()
        self._safety_factor = 5.0
        self._min_timeout = 0.0
        self.calculated = Timeouts()
        """Timeouts learned by calculate_and_set_timeouts(), merged across cycles (saved in state)."""
        self.effective_timeouts: Optional[Timeouts] = None
        """What the monitor enforces for this rank, after the last update."""
        self._unenforced: frozenset = frozenset()
        """Timeouts the launcher left unenforced (None): learning never switches one on."""
        self._dump_signal: Optional[signal.Signals] = None
        self._dump_file: Optional[IO[str]] = None
        self._dump_claim: Optional[SignalClaim] = None
        self._uncaught: Optional[UncaughtExceptionRecorder] = None
        self._events: Optional[ev.EventLog] = None
        self.cfg: Optional[FTConfig] = None
        """The monitor's config, once registered (nvidia-resiliency-ext's name)."""

    @property
    def is_active(self) -> bool:
        return self._link is not None

    # ---- lifecycle -------------------------------------------------------------
    def init_workload_monitoring(self, connect_timeout: float = 30.0) -> bool:
        """Connect and register this rank; return False (and warn) when no monitor exists."""
        if not self._path:
            logger.warning(
                "fault tolerance monitoring is INACTIVE: this process was not started by ft_launcher "
                "(%s is not set), so hangs will not be detected. Launch with `ft_launcher ... train.py`.",
                MONITOR_SOCKET_ENV,
            )
            return False
        if self._link is not None:
            return True
        init = encode(
            "init",
            rank=dist_env.rank(), local_rank=dist_env.local_rank(), pid=os.getpid(),
            cycle=dist_env.restart_count(),
        )
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(connect_timeout)
        try:
            sock.connect(self._path)
        except OSError as e:
            sock.close()
            raise MonitorUnreachable(f"cannot reach the ft_launcher node monitor at {self._path}: {e}") from None
        try:
            sock.sendall(init)
            reply = read_reply(sock, connect_timeout)
        except OSError as e:
            sock.close()
            raise MonitorUnreachable(f"the node monitor at {self._path} did not register this rank: {e}") from None
        if reply["t"] != "init_ok":
            sock.close()
            raise MonitorUnreachable(f"node monitor refused this rank: {reply.get('reason')}")
        cfg = reply["config"]
        self.cfg = FTConfig.from_json(cfg)
        self._safety_factor = float(cfg["safety_factor"])
        self._min_timeout = float(cfg.get("min_calculated_timeout", 0.0))
        self._section_names = tuple(sorted(cfg["rank_section_timeouts"]))
        self.effective_timeouts = Timeouts.from_json(reply["timeouts"], source="monitor timeouts")
        self._unenforced = _unenforced(self.effective_timeouts)
        self._observer = IntervalObserver(int(cfg["num_warmup_iterations"]))
        self._registered_at = self._clock()
        self._observer.on_start(self._registered_at)
        self._dump_signal = parse_signal(cfg["stack_dump_signal"], "stack_dump_signal")
        self._register_stack_dump(reply.get("stack_file"))
        self._link = MonitorLink(self._path, sock, self._lock, init, self._state_message, self._reregistered,
                                 answers={"dump_collectives": collectives_message})
        self._events = ev.EventLog.from_env(source="ft.client")
        self._uncaught = UncaughtExceptionRecorder(self._events)
        self._uncaught.install()
        if self.calculated != Timeouts():
            self._push_timeouts()
        return True

    def _reregistered(self, reply: dict) -> None:
        """Called by the link's thread after a reconnect: the (maybe new) monitor's dump file."""
        self._register_stack_dump(reply.get("stack_file"))

    def _register_stack_dump(self, path: Optional[str]) -> None:
        """faulthandler dumps every thread's stack on the dump signal: into the file the monitor
        reads and prints as one block after the kill (several ranks dumping into one shared
        stderr at the same moment would interleave), or into stderr where the monitor named no
        file. Opened afresh at each registration: a monitor may have removed the old one."""
        old, self._dump_file = self._dump_file, None
        beside_socket = isinstance(path, str) and os.path.dirname(path) == os.path.dirname(self._path)
        if beside_socket:  # the monitor's private directory, nowhere else
            try:
                self._dump_file = open(path, "w")
            except OSError as e:
                logger.warning("stack dumps go to stderr: cannot open %s: %s", path, e)
        self._claim_stack_dump(self._dump_file)
        if old is not None:
            old.close()

    def _claim_stack_dump(self, file: Optional[IO[str]]) -> None:
        """Hold the dump signal in the process's signal registry (owner "ft.client"): a dump
        claim shares the signal with the in-process Wrapper's dump (this one's file wins while
        held); a Python handler on it (another part configured with the same signal) is
        refused with both owners named. Works from the link's reconnect thread too."""
        self._dump_claim = default_registry().claim(
            self._dump_signal, STACK_DUMP_OWNER, FaultHandlerDump(file, all_threads=True), replace=True)

    def shutdown_workload_monitoring(self) -> None:
        """Tell the monitor this rank is leaving on purpose (no hang), then disconnect."""
        if self._link is None:
            return
        link, self._link = self._link, None
        link.close(farewell=encode("bye"))
        if self._uncaught is not None:
            self._uncaught.uninstall()
            self._uncaught = None
        if self._dump_claim is not None:  # undo what init installed: the signal is free again
            self._dump_claim.release()
            self._dump_claim = None
        if self._dump_file is not None:  # the monitor removes the file
            self._dump_file.close()
            self._dump_file = None

    # ---- hot path --------------------------------------------------------------
    def send_heartbeat(self) -> None:
        link = self._link
        if link is None:
            return
        with self._lock:
            now = self._clock()
            self._observer.on_heartbeat(now)
            self._heartbeats += 1
            self._last_heartbeat = now
            link.send(_HEARTBEAT)

    def start_section(self, section: str) -> None:
        link = self._link
        if link is None:
            return
        msg = self._section_msg(section)[0]
        with self._lock:
            self._sections_used = True
            self._observer.on_section_start(section, self._clock())
            link.send(msg)

    def end_section(self, section: str) -> None:
        link = self._link
        if link is None:
            return
        msg = self._section_msg(section)[1]
        with self._lock:
            now = self._clock()
            was_open = section in self._observer.open_sections
            self._observer.on_section_end(section, now)
            if was_open:
                self._section_ends += 1
                if not self._observer.open_sections:
                    self._last_section_end = now
            link.send(msg)

    def end_all_sections(self) -> None:
        link = self._link
        if link is None:
            return
        with self._lock:
            now = self._clock()
            if self._observer.open_sections:
                for name in list(self._observer.open_sections):
                    self._observer.on_section_end(name, now)
                self._section_ends += 1
                self._last_section_end = now
            link.send(_END_ALL)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.start_section(name)
        try:
            yield
        finally:
            self.end_section(name)

    def report_training_resumed(self, iteration: int) -> None:
        """Call as this process's first training step begins, with the step training resumes
        from (0 on a fresh start). On rank 0, a training_resumed event: `nvrx report` times the
        first step of each cycle and attempt from it and tells which steps were run again."""
        events = self._events
        if self._link is not None and events is not None and events.path and events.rank == 0:
            events.emit(ev.TRAINING_RESUMED, step=int(iteration))

    def report_progress(self, iteration: int) -> None:
        """Tell the launcher how far training got (it gives up after cycles with no progress);
        on rank 0, also a step_done event: `nvrx report` times the steps from them (ETTR)."""
        link = self._link
        if link is None:
            return
        msg = encode("progress", iteration=int(iteration))
        with self._lock:
            self._iteration = max(int(iteration), self._iteration if self._iteration is not None else int(iteration))
            link.send(msg)
        events = self._events
        if events is not None and events.path and events.rank == 0:  # the report's step timeline
            events.emit(ev.STEP_DONE, step=int(iteration))

    # ---- timeouts --------------------------------------------------------------
    def calculate_and_set_timeouts(self, skip_if_not_ready: bool = False, exclude: Iterable[str] = (),
                                   require: Iterable[str] = ()) -> bool:
        """Collective: timeouts = safety_factor x the longest interval seen on any rank
        (at least min_calculated_timeout).

        Every rank must call it (it all-reduces). Values are merged with earlier calculated
        ones (max), pushed to the monitor, and kept in state_dict(). Returns False when
        skipped because some rank had not observed anything yet and skip_if_not_ready.

        `exclude` names timeouts this run's observations must not set ("initial_heartbeat",
        "heartbeat", "out_of_section" or a section name): a run that started from scratch has
        not seen how long a start that loads a checkpoint takes, and learning its quick start
        would kill every later restart during the load. A timeout the launcher left
        unenforced is never learned (a rank that sends heartbeats under section timeouts
        must not start being judged by them), so naming one is harmless. `require` names
        timeouts some rank must have observed: else False if skip_if_not_ready, else
        RankMonitorClientError (nvidia-resiliency-ext's calls learn only from enough data).
        """
        exclude = frozenset(exclude) | self._unenforced
        if self._link is None:
            return False
        observed = self._observer.observed(self._section_names)
        values = [observed.initial_heartbeat, observed.heartbeat, observed.out_of_section]
        values += [observed.sections[n] for n in self._section_names]
        ready = any(v is not None for v in values[1:])
        reduced = _all_reduce_max([(-1.0 if v is None else v) for v in values] + [0.0 if ready else 1.0])
        names = ["initial_heartbeat", "heartbeat", "out_of_section", *self._section_names]
        missing = [n for n, v in zip(names, reduced) if n in set(require) and v <= 0]
        if skip_if_not_ready and (missing or reduced[-1] > 0):
            return False
        if missing:
            raise RankMonitorClientError(f"not enough data to calculate the {', '.join(missing)} timeouts yet")
        learned = {n: (v if v > 0 and n not in exclude else None) for n, v in zip(names, reduced[:-1])}
        maxima = Timeouts(
            initial_heartbeat=learned["initial_heartbeat"],
            heartbeat=learned["heartbeat"],
            out_of_section=learned["out_of_section"],
            sections={n: learned[n] for n in self._section_names},
        )
        with self._lock:
            self.calculated = self.calculated.merged_max(scale(maxima, self._safety_factor, self._min_timeout))
        self._push_timeouts()
        return True

    def _push_timeouts(self) -> None:
        msg = encode("timeouts", timeouts=self.calculated.to_json())
        with self._lock:
            self._link.send(msg)
        if self.effective_timeouts is not None:
            self.effective_timeouts = self.effective_timeouts.overridden_by(self.calculated)

    # ---- state -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "calculated_timeouts": self.calculated.to_json()}

    def load_state_dict(self, state: dict) -> None:
        """Our state_dict(), or nvidia-resiliency-ext's client state (its learned values)."""
        if isinstance(state, dict) and NVRX_STATE_KEY in state:
            state = state_from_nvrx(state, STATE_VERSION)
        if state == {}:  # what a checkpoint without fault tolerance state gives (`.get(key, {})`)
            return
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ConfigError(f"fault tolerance state: expected version {STATE_VERSION}, got {state!r:.200}")
        calculated = Timeouts.from_json(state.get("calculated_timeouts", {}), "calculated_timeouts")
        with self._lock:
            self.calculated = calculated
        if self._link is not None and self.calculated != Timeouts():
            self._push_timeouts()

    def save_state(self, directory: str) -> str:
        """Write ft_state.json atomically into `directory` (e.g. next to the checkpoint)."""
        path = os.path.join(directory, STATE_FILE_NAME)
        atomic_write_json(path, self.state_dict())
        return path

    def load_state(self, directory: str) -> bool:
        """Load ft_state.json from `directory` if present; a corrupt file raises ConfigError."""
        path = os.path.join(directory, STATE_FILE_NAME)
        try:
            with open(path, "rb") as f:
                state = json.load(f)
        except FileNotFoundError:
            return False
        except ValueError as e:
            raise ConfigError(f"{path}: not valid JSON ({e}); delete it to start with configured timeouts") from None
        try:
            self.load_state_dict(state)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        return True

    # ---- plumbing --------------------------------------------------------------
    def _section_msg(self, name: str) -> tuple:
        msgs = self._section_msgs.get(name)
        if msgs is None:
            # A name missing from a configured set is likely a typo; with no section timeouts at
            # all (a heartbeat-only launch) sections are simply not judged: nothing to say.
            if self._section_names and name not in self._section_names:
                logger.warning("section %r has no timeout in rank_section_timeouts; it is not enforced", name)
            msgs = self._section_msgs[name] = (encode("ss", name=name), encode("se", name=name))
        return msgs

    def _state_message(self) -> bytes:
        """The rank's whole view for the monitor (built by the link's thread, lock held)."""
        now = self._clock()
        age = lambda t: None if t is None else max(0.0, now - t)  # noqa: E731
        return encode(
            "state", since_init=age(self._registered_at), heartbeats=self._heartbeats,
            hb_age=age(self._last_heartbeat), sections_used=self._sections_used,
            open={name: age(t) for name, t in self._observer.open_sections.items()},
            section_ends=self._section_ends, se_age=age(self._last_section_end), iteration=self._iteration,
            timeouts=self.calculated.to_json() if self.calculated != Timeouts() else None,
        )


def _unenforced(timeouts: Timeouts) -> frozenset:
    names = {"initial_heartbeat": timeouts.initial_heartbeat, "heartbeat": timeouts.heartbeat,
             "out_of_section": timeouts.out_of_section, **timeouts.sections}
    return frozenset(name for name, seconds in names.items() if seconds is None)


def _all_reduce_max(values: list) -> list:
    """Max over all ranks; a plain copy when torch.distributed is not initialised."""
    from nvrx_core.collectives import all_reduce_max  # imports torch: only when timeouts are calculated

    return all_reduce_max([float(v) for v in values])
