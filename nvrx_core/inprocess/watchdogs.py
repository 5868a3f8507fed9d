"""The three watchdogs of a rank, started and stopped together by the Wrapper.

- MonitorThread: soft timeout, peers' faults, heartbeats; store requests through a
  BoundedStore, so it goes on evaluating the soft timeout while the store stalls.
- ProgressReporter: pokes the main thread and feeds its progress to the monitor process
  through a pipe; it never touches the store.
- MonitorProcess: the hard timeout; it declares a rank it kills (or sees die) in the store
  from a thread of its own, so a stalled store never delays the kill.

Connections are opened by connect(), before the Wrapper's first barrier: a TCPStore
connection can stall for seconds (reverse DNS on both ends, see store.py), and at a
barrier that costs nothing, while a connection opened as ranks train can stall the store
server for everyone.
"""

import logging
import os
from typing import Optional

from nvrx_core import events as ev
from nvrx_core.inprocess.abort import AbortProcessGroups
from nvrx_core.inprocess.config import InProcessConfig
from nvrx_core.inprocess.coordination import Coordinator
from nvrx_core.inprocess.interruption import MainThreadInterrupter, MainThreadProgress
from nvrx_core.inprocess.monitor_process import MonitorProcess, MonitorSettings, ProgressReporter
from nvrx_core.inprocess.monitor_thread import MonitorThread
from nvrx_core.inprocess.records import Cause
from nvrx_core.inprocess.store import BoundedStore, StoreClients
from nvrx_core.signals import FaultHandlerDump, SignalClaim, default_registry

logger = logging.getLogger("nvrx.inprocess")


class Watchdogs:
    def __init__(self, config: InProcessConfig, clients: StoreClients, prefix: str, rank: int):
        self.config, self.clients, self.prefix, self.rank = config, clients, prefix, rank
        self.store: BoundedStore = clients.bounded(config.store_request_timeout, f"rank{rank}-monitor")
        self.progress = MainThreadProgress()
        self.monitor: Optional[MonitorThread] = None
        self.reporter: Optional[ProgressReporter] = None
        self.process: Optional[MonitorProcess] = None
        self._dump_claim: Optional[SignalClaim] = None

    def connect(self) -> None:
        """Open the monitor thread's store connection now (see the module docstring)."""
        self.store.connect_now()

    def start(self, interrupter: MainThreadInterrupter, abort: AbortProcessGroups, events: ev.EventLog) -> MonitorThread:
        self.process = self._start_monitor_process(self.config.monitor_process_period)
        self.monitor = MonitorThread(Coordinator(self.store, self.prefix, self.rank), self.config, interrupter,
                                     self.progress, abort, events)
        monitor = self.monitor
        self.reporter = ProgressReporter(self.progress, self.process, lambda: monitor.in_function,
                                         self.config.progress_period,
                                         machinery_allowance=self.config.barrier_timeout)
        self.monitor.start()
        self.reporter.start()
        return self.monitor

    def stop(self) -> None:
        if self.monitor is not None:
            self.monitor.shutdown()
        if self.reporter is not None:
            self.reporter.shutdown()
        if self.process is not None:
            self.process.stop()
        if self._dump_claim is not None:  # undo what start() installed
            self._dump_claim.release()
            self._dump_claim = None
        self.store.close()
        if self.store.stalls or self.store.max_latency > self.store.slow:
            logger.info("rank %d: the store's slowest answer to the monitor thread took %.2f s; %d request(s) got "
                        "none within %.1f s", self.rank, self.store.max_latency, self.store.stalls, self.store.timeout)

    def _start_monitor_process(self, interval: float) -> MonitorProcess:
        config = self.config
        log_path = None
        if config.monitor_log_dir:
            os.makedirs(config.monitor_log_dir, exist_ok=True)
            log_path = os.path.join(config.monitor_log_dir, f"monitor_rank{self.rank}.log")
        settings = MonitorSettings(self.rank, config.hard_timeout, config.termination_grace,
                                   config.signal_number("termination_signal"), interval, log_path,
                                   config.signal_number("stack_dump_signal"),
                                   declare_timeout=min(config.barrier_timeout, 60.0))
        dump = settings.stack_dump_signal
        signals = default_registry()
        if dump is not None and self._dump_claim is None and signals.is_free(dump):
            # The monitor process sends this before the kill. Where another part already holds
            # the signal it is left alone: the ft client's dump goes to the file the node
            # monitor prints, and a Python handler belongs to another part of the job.
            self._dump_claim = signals.claim(dump, "inprocess.wrapper", FaultHandlerDump(all_threads=True))
        clients, prefix, rank = self.clients, self.prefix, self.rank

        def declare(cause: Cause, detail: str) -> None:  # runs in the monitor process, in a thread of its own
            Coordinator(clients.connect(), prefix, rank).mark_terminated(rank, cause, detail)

        process = MonitorProcess(settings, declare)
        process.start()
        return process
