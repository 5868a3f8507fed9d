"""FaultTolerantAgent: torch.distributed.elastic's local agent plus what fault tolerance needs.

torch's agent already owns the restart loop, rendezvous and process management; this
subclass only hooks into its extension points:
- before each (re)start: health checks, and a new cycle announced to the node monitor;
- per attempt: a fresh, empty TCPStore for the workers (hosted by the agent of group rank
  0 on a new port), so restarted workers can never read the previous attempt's keys
  (pytorch#135712: torch reuses the rendezvous store, and restarted workers picked up stale
  process-group keys about half the time);
- on failure (also of a worker killed while writing its error record for torch): events,
  a record of which ranks died how and which ones torch's poll stopped because of that,
  terminal exit codes that must not be retried (preempted, straggler stop, rerun verdicts),
  and a limit on restart cycles that made no progress;
- stopping workers for a restart waits --workers-stop-timeout, not torch's fixed 30 s;
- a stop signal from outside (the scheduler's preemption warning): forwarded to the workers
  as torch does, given torch's shutdown_timeout (--shutdown-timeout / --term-timeout, by
  default --workers-stop-timeout), then their exits say whether they saved (ft/stop_signal.py);
- under respawn-rank (settings.respawn), a dead worker replaced in place while the others run
  (ft/respawn.py): one WorkerRespawner per cycle, stopped before any worker is.
"""

import dataclasses
import logging
import os
import pickle
import signal
import time
import uuid
from typing import Callable, Dict, List, Optional, Set, Tuple

from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from nvrx_core import events as ev
from nvrx_core.exit_codes import TERMINAL_EXIT_CODES, ExitCode
from nvrx_core.ft.monitor_handle import MonitorHandle, MonitorLost
from nvrx_core.ft.process_groups import kill_process_groups
from nvrx_core.ft.respawn import Respawned, RespawnPolicy, WorkerRespawner
from nvrx_core.ft.respawn_marker import RESPAWN_DIR_ENV
from nvrx_core.ft.stop_signal import SignalStop, StopSignals, handled_signals
from nvrx_core.proc import ProcessHandle
from nvrx_core.torch_compat import check_agent_hooks, restarts_left, worker_exits, worker_processes

logger = logging.getLogger("nvrx.ft.launcher")

__all__ = ["AgentSettings", "FaultTolerantAgent", "LauncherStop", "TERMINAL_EXIT_CODES", "stopped_by_the_poll"]

_WORKER_STORE_KEY = "nvrx/worker_store"
HealthCheck = Callable[[], Tuple[bool, str]]


class LauncherStop(Exception):
    """The launcher must stop now with `exit_code` (no further restart). `close_rendezvous`:
    the other nodes end too (False: they go on without this one)."""

    def __init__(self, exit_code: int, reason: str, close_rendezvous: bool = True):
        super().__init__(reason)
        self.exit_code = exit_code
        self.close_rendezvous = close_rendezvous


@dataclasses.dataclass
class AgentSettings:
    workers_stop_timeout: float = 15.0
    max_no_progress_restarts: int = 3
    health_checks: List[HealthCheck] = dataclasses.field(default_factory=list)
    respawn: Optional[RespawnPolicy] = None
    """respawn-rank: replace a dead worker in place when this policy allows it (None: never)."""


class FaultTolerantAgent(LocalElasticAgent):
    def __init__(self, *args, settings: AgentSettings, monitor: MonitorHandle, events: ev.EventLog,
                 shutdown_timeout: Optional[float] = None, **kwargs):
        if shutdown_timeout is None:
            shutdown_timeout = settings.workers_stop_timeout
        super().__init__(*args, shutdown_timeout=shutdown_timeout, **kwargs)
        self.shutdown_timeout = shutdown_timeout
        """The grace torch's run() gives the workers after a stop signal and at its end."""
        self.settings = settings
        self.monitor = monitor
        self.events = events
        self.attempt = 0
        self._attempt_store: Optional[TCPStore] = None
        self._failure_reported = False
        self._best_iteration: Optional[int] = None
        self._no_progress_cycles = 0
        self.last_failures: Dict[int, int] = {}
        self._worker_groups: Set[int] = set()
        self._worker_handles: Dict[int, Optional[ProcessHandle]] = {}
        self.signal_stop: Optional[SignalStop] = None
        """The stop signal this launcher received from outside, if any, and the workers' exits."""
        self.stop_signals = StopSignals(handled_signals())
        """Armed by the launcher before run(), released at its end."""
        self._respawner: Optional[WorkerRespawner] = None
        self._respawn_starts: List[float] = []
        """When this node's replacements started (respawn-rank's budget spans restart cycles)."""

    # ---- start -----------------------------------------------------------------
    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        self._run_health_checks()
        super()._initialize_workers(worker_group)

    def _run_health_checks(self) -> None:
        for check in self.settings.health_checks:
            healthy, detail = check()
            self.events.emit(ev.HEALTH_CHECK, cycle=self.attempt, check=getattr(check, "__name__", str(check)),
                             healthy=healthy, detail=detail)
            if not healthy:
                raise LauncherStop(ExitCode.FAILURE, f"node health check failed: {detail}")

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        started = time.monotonic()
        super()._rendezvous(worker_group)
        self._serve_fresh_worker_store(worker_group)
        self.events.emit(
            ev.RENDEZVOUS_DONE, cycle=self.attempt, group_rank=worker_group.group_rank,
            group_world_size=worker_group.group_world_size, seconds=round(time.monotonic() - started, 3),
        )

    _worker_store_token: Optional[str] = None
    """The token of the last worker store address this node used (see below)."""

    def _serve_fresh_worker_store(self, worker_group: WorkerGroup) -> None:
        """Give this round's workers an empty store; its address agreed through the rendezvous store.

        The key names no attempt count: nodes count attempts differently (one that joined an
        elastic job late has restarted fewer times than the others), so a key built from a
        local counter is one that nobody else writes. The c10d (and etcd) handlers hand out a
        store namespaced by the rendezvous round, which every node of a round shares; in it
        the one fixed key is fresh. A handler whose store is not namespaced per round (static:
        a fixed set of nodes) may still hold the previous round's address, so each address
        carries a new token and a node waits until it sees one it has not used yet.
        """
        store = worker_group.store
        self._attempt_store = None  # drop the previous round's server first
        if worker_group.group_rank == 0:
            host = worker_group.master_addr
            self._attempt_store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
            store.set(_WORKER_STORE_KEY, f"{uuid.uuid4().hex} {host}:{self._attempt_store.port}")
        deadline = time.monotonic() + store.timeout.total_seconds()
        token, address = store.get(_WORKER_STORE_KEY).decode().split(" ", 1)
        while token == self._worker_store_token:  # the previous round's: rank 0 has not written yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"no new worker store address from group rank 0 within {store.timeout}")
            time.sleep(0.05)
            token, address = store.get(_WORKER_STORE_KEY).decode().split(" ", 1)
        self._worker_store_token = token
        host, _, port = address.rpartition(":")
        worker_group.master_addr = host
        worker_group.master_port = int(port)

    def _start_workers(self, worker_group: WorkerGroup) -> Dict[int, int]:
        self._supervise_monitor()
        try:
            self.monitor.new_cycle(self.attempt)
        except MonitorLost as e:
            raise LauncherStop(ExitCode.MONITOR_LOST, str(e)) from None
        except OSError as e:  # a stopped monitor: its progress record for this cycle is off, nothing else
            logger.warning("the node monitor did not take the new cycle: %s", e)
        self._failure_reported = False
        pids = super()._start_workers(worker_group)
        by_rank = {w.global_rank: pids[w.local_rank] for w in worker_group.workers if w.local_rank in pids}
        self.monitor.workers_started(by_rank)
        self._worker_groups = set(pids.values())  # each worker leads its own process group
        self._hold_workers(by_rank)
        self.events.emit(ev.WORKERS_STARTED, cycle=self.attempt,
                         pids={str(w.global_rank): pids.get(w.local_rank) for w in worker_group.workers})
        if self.settings.respawn is not None:
            self._respawner = WorkerRespawner(
                worker_processes(self), {w.local_rank: w.global_rank for w in worker_group.workers},
                self.settings.respawn, os.environ.get(RESPAWN_DIR_ENV), self._respawn_starts, self._hung_pids,
                self._replaced, self.events, self.attempt)
            self._respawner.start()
        return pids

    # ---- respawn-rank (ft/respawn.py) ---------------------------------------------
    def _hung_pids(self) -> Optional[Set[int]]:
        """The pids the node monitor took down as hung this cycle (None: it could not say)."""
        try:
            return set(self.monitor.cycle_stats().get("hung_pids", []))
        except (MonitorLost, OSError, ValueError) as e:
            logger.warning("could not ask the node monitor which ranks it killed as hung: %s", e)
            return None

    def _replaced(self, done: Respawned) -> None:
        """A worker runs as a new process (under the respawner's lock): torch's poll checks its
        workers' ids against the process context's pids, the node monitor adopts it if it
        restarts, and the cycle's end kills its process group, as any worker's."""
        self.get_worker_group().workers[done.local_rank].id = done.new_pid
        self.monitor.worker_replaced(done.rank, done.new_pid)
        self._worker_groups.add(done.new_pid)
        old = self._worker_handles.pop(done.rank, None)
        if old is not None:
            old.close()
        try:
            self._worker_handles[done.rank] = ProcessHandle.open(done.new_pid)
        except ProcessLookupError:
            self._worker_handles[done.rank] = None

    def _stop_respawner(self) -> None:
        """No worker is replaced once the agent stops them: first of every stop, restart and end."""
        if self._respawner is not None:
            self._respawner.stop()  # a stop signal may cut it short: the next stop finishes it
            self._respawner = None

    # ---- monitor / restart -----------------------------------------------------
    def _supervise_monitor(self) -> None:
        """No rank may run unwatched: restart the node monitor if it died (before each cycle and
        every monitor_interval while workers run); stop the job if it keeps dying."""
        try:
            self.monitor.ensure_running()
        except MonitorLost as e:
            raise LauncherStop(ExitCode.MONITOR_LOST, str(e)) from None

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        respawner = self._respawner
        if respawner is None:
            result, terminal = self._poll_workers(worker_group)
        else:
            with respawner.lock:  # a death is replaced before torch's poll could see it (ft/respawn.py)
                respawner.handle_exits()
                result, terminal = self._poll_workers(worker_group)
                if result.state != WorkerState.HEALTHY:
                    respawner.close()
        if terminal:  # outside the lock: stopping the workers waits for the respawner's thread
            self._stop_workers(worker_group)
            raise LauncherStop(terminal[0], f"a worker exited with {ExitCode(terminal[0]).name}; not restarting")
        return result

    def _poll_workers(self, worker_group: WorkerGroup) -> Tuple[RunResult, List[int]]:
        """torch's poll, and the failure it reports (once per cycle): (its result, the terminal
        exit codes among the failed workers')."""
        self._supervise_monitor()
        running_before = {rank for rank, handle in self._worker_handles.items()
                          if handle is not None and not handle.exited()}
        try:
            result = super()._monitor_workers(worker_group)
        except (EOFError, pickle.UnpicklingError) as e:
            result = self._failed_without_a_readable_error(worker_group, e)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and not self._failure_reported:
            self._failure_reported = True
            self.last_failures = {rank: f.exitcode for rank, f in result.failures.items()}
            self.events.emit(ev.WORKERS_FAILED, cycle=self.attempt,
                             exit_codes={str(r): c for r, c in self.last_failures.items()},
                             stopped_ranks=stopped_by_the_poll(self.last_failures, running_before))
            return result, sorted({c for c in self.last_failures.values() if c in TERMINAL_EXIT_CODES})
        return result, []

    def _failed_without_a_readable_error(self, worker_group: WorkerGroup, error: Exception) -> RunResult:
        """A worker killed while it wrote its traceback for torch (the node monitor's kill of a
        hung rank, torch's own stop of the others) leaves an empty or cut-off pickle, and torch's
        poll raises reading it instead of reporting the failure. The failure is what counts:
        every worker that exited non-zero, with its exit code, and the restart goes on."""
        failures = {}
        exits = worker_exits(self)
        for worker in worker_group.workers:
            pid, code = exits.get(worker.local_rank, (-1, None))
            if code not in (None, 0):
                failures[worker.global_rank] = ProcessFailure(local_rank=worker.local_rank, pid=pid, exitcode=code,
                                                              error_file="")
        logger.warning("a failed worker's error record could not be read (%s: %s); failed ranks %s",
                       type(error).__name__, error, {rank: f.exitcode for rank, f in failures.items()})
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._stop_respawner()
        stats = self._cycle_stats()
        if stats is not None:
            self._act_on_workload_requests(stats)
            self._check_progress(stats)
        self.attempt += 1
        self.events.emit(ev.RESTART_BEGUN, cycle=self.attempt,
                         remaining_restarts=restarts_left(self), failed_ranks=sorted(self.last_failures))
        super()._restart_workers(worker_group)

    def _cycle_stats(self) -> Optional[dict]:
        """What the node monitor saw of the failed cycle (None: it could not say)."""
        try:
            return self.monitor.cycle_stats()
        except MonitorLost as e:
            raise LauncherStop(ExitCode.MONITOR_LOST, str(e)) from None
        except OSError as e:
            logger.warning("could not read progress from the node monitor: %s", e)
            return None

    def _act_on_workload_requests(self, stats: dict) -> None:
        """A rank's request (nvidia-resiliency-ext's WorkloadControlRequest), acted on at the
        failure that follows it, as the peer does at its next rendezvous: ShutdownWorkload ends
        the job on every node (the rendezvous closes), ExcludeThisNode takes this node out."""
        asked = stats.get("workload_requests") or {}
        for action, code, close in (("ShutdownWorkload", ExitCode.WORKLOAD_SHUTDOWN, True),
                                    ("ExcludeThisNode", ExitCode.NODE_EXCLUDED, False)):
            ranks = sorted(int(rank) for rank, wanted in asked.items() if wanted == action)
            if ranks:
                raise LauncherStop(code, f"rank(s) {ranks} asked for {action}: no restart"
                                   + ("" if close else "; this node leaves the job"), close_rendezvous=close)

    def _check_progress(self, stats: dict) -> None:
        """Count consecutive cycles that got no further than before; stop at the limit."""
        limit = self.settings.max_no_progress_restarts
        iteration = stats.get("max_iteration")
        if self._best_iteration is not None or iteration is not None:
            progressed = iteration is not None and (self._best_iteration is None or iteration > self._best_iteration)
            if progressed:
                self._best_iteration = iteration
        else:
            progressed = stats.get("heartbeats", 0) > 0 or stats.get("section_ends", 0) > 0
        self._no_progress_cycles = 0 if progressed else self._no_progress_cycles + 1
        if limit > 0 and self._no_progress_cycles >= limit:
            raise LauncherStop(
                ExitCode.NO_PROGRESS,
                f"{self._no_progress_cycles} consecutive restart cycles made no progress "
                f"(best iteration {self._best_iteration}); giving up instead of looping",
            )

    def _stop_workers(self, worker_group: WorkerGroup, *args, **kwargs) -> None:
        self._shutdown(timeout=self.settings.workers_stop_timeout)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: Optional[float] = None) -> None:
        """Stop the workers (torch: `death_sig`, `timeout` seconds, then SIGKILL), note their
        exits if a stop signal asked for this, then kill everything they started (process_groups).

        `timeout`: --workers-stop-timeout from _stop_workers (a restart); torch's run() passes
        its shutdown_timeout for a stop signal and at its end."""
        grace = self.shutdown_timeout if timeout is None else timeout
        self._stop_respawner()
        super()._shutdown(death_sig, grace)
        stop = self.signal_stop
        if stop is not None and stop.exit_codes is None:
            stop.exit_codes = self._exit_codes()
            self.events.emit(ev.LAUNCHER_SIGNALED, cycle=self.attempt, signal=stop.signal.name,
                             running_ranks=stop.running_ranks, preempted=stop.preempted,
                             exit_codes={str(rank): code for rank, code in stop.exit_codes.items()},
                             grace_s=grace)
        kill_process_groups(self._worker_groups)
        self._worker_groups = set()
        self._hold_workers({})

    # ---- a stop signal from outside (ft/stop_signal.py) ----------------------------
    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            return super()._invoke_run(role)
        except SignalException as e:
            self._stop_signal_received(e.sigval)
            raise  # torch's run() forwards it to the workers: our _shutdown(e.sigval)

    def _stop_signal_received(self, sig: signal.Signals) -> None:
        self._stop_respawner()  # a worker the signal ended is not replaced
        running = sorted(rank for rank, h in self._worker_handles.items() if h is not None and not h.exited())
        self.signal_stop = SignalStop(sig, running)
        grace = self.shutdown_timeout
        logger.warning("received %s: forwarding it to the running workers (ranks %s), which have %.0f s to exit "
                       "before SIGKILL; no restart follows", sig.name, running, grace)
        self.stop_signals.hold(grace)

    def _exit_codes(self) -> Dict[int, Optional[int]]:
        """{global rank: exit code (None: still alive; -N: killed by signal N)} of this cycle's workers."""
        by_local = {w.local_rank: w.global_rank for w in self.get_worker_group().workers}
        return {by_local.get(local, local): code for local, (_, code) in sorted(worker_exits(self).items())}

    def _hold_workers(self, pids: Dict[int, int]) -> None:
        """Hold this cycle's workers by pidfd ({global rank: pid}), releasing the last cycle's;
        None for a worker gone already (it exited before any poll)."""
        for handle in self._worker_handles.values():
            if handle is not None:
                handle.close()
        self._worker_handles = {}
        for rank, pid in pids.items():
            try:
                self._worker_handles[rank] = ProcessHandle.open(pid)
            except ProcessLookupError:
                self._worker_handles[rank] = None


def stopped_by_the_poll(codes: Dict[int, int], running_before: Set[int]) -> List[int]:
    """The ranks that torch's poll itself stopped, from {rank: exit code} of one failure and
    the ranks still running when that poll began.

    Once one worker has failed, torch's poll terminates the rest; a cold start lists them
    among the failures too, with exit codes that look like outside kills, a warm start not at
    all (they just vanish). A rank running when the poll began and not failed on its own (no
    exit code, or the stop's SIGTERM or the SIGKILL after it) was stopped, not faulty: an
    incident report must not blame it. If no rank is left that failed on its own, one died
    just as the poll began and the two cannot be told apart: none is named.
    """
    stop_codes = (-signal.SIGTERM, -signal.SIGKILL)
    failed_on_its_own = {rank for rank, code in codes.items() if rank not in running_before or code not in stop_codes}
    if not failed_on_its_own:
        return []
    return sorted(running_before - failed_on_its_own)


check_agent_hooks(FaultTolerantAgent)
