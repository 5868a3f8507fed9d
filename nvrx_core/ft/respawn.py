"""respawn-rank: a dead worker is replaced in place while its peers go on running.

torch's agent answers any worker's failure by stopping every worker, rendezvousing and starting
them all again: every rank pays a fresh interpreter, its imports, its data loaders and its
process groups. Under `--ft-restart-policy respawn-rank` a worker that dies is instead replaced
by a new process of the same rank, forked from the same warm fork server, and the others keep
their processes; the in-process Wrapper (nvrx_core.inprocess) aborts the survivors' collectives
and takes the replacement back into the job. Only a worker that runs the Wrapper can be taken
back, and some deaths must not be replaced at all, so each is put to `decide`; a death it
declines is left to torch's poll, which restarts every worker as before.

Why a watcher thread and a lock: torch's poll (`ProcessContext.join(-1)`, every monitor
interval) terminates every other worker the moment it finds one that exited non-zero, so a
death the policy replaces must be dealt with before that poll can see it. The exit watcher
waits on the workers' sentinels (woken by the kernel, no polling interval) and handles a death
as soon as one is readable; the agent's poll takes the same lock and first handles any exit
itself, then lets torch's poll run. Whoever sees a death first handles it the same way. A
death that lands in the moment between the agent's look and torch's own is torch's: every
worker restarts, which is the policy's safe side.

A replacement runs torch's own worker body (`_wrap`) with the dead worker's arguments: its
rank, TORCHELASTIC_RESTART_COUNT and every other variable torch set are the dead one's, except
NVRX_RANK_INCARNATION (n for a rank's n-th replacement in a restart cycle; the launcher gives
the cycle's first processes 0). The private torch objects this touches are reached through
nvrx_core.torch_compat.
"""

import dataclasses
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set

from nvrx_core import events as ev
from nvrx_core.config import check
from nvrx_core.exit_codes import TERMINAL_EXIT_CODES, ExitCode
from nvrx_core.ft.respawn_marker import INCARNATION_ENV, wrapper_pid
from nvrx_core.torch_compat import WorkerProcesses, check_worker_respawn, start_worker_process

logger = logging.getLogger("nvrx.ft.launcher")

ELASTIC_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


@dataclasses.dataclass
class RespawnPolicy:
    """When a dead worker may be replaced in place (ft_launcher --ft-restart-policy respawn-rank)."""

    max_respawns: int = 3
    """Replacements this node may start within `window_s` (--max-respawns): a job whose ranks keep
    dying is better served by a restart of every rank, which the launcher counts and limits."""
    window_s: float = 300.0
    """The sliding window of max_respawns, in seconds (--respawn-window)."""
    min_uptime_s: float = 5.0
    """A replacement that dies within this many seconds of its start cannot come up in place:
    its death restarts every worker."""

    def __post_init__(self):
        check(isinstance(self.max_respawns, int) and self.max_respawns >= 1,
              "RespawnPolicy.max_respawns (--max-respawns)", self.max_respawns,
              "must be an integer >= 1 (for none: --ft-restart-policy any-failed)")
        check(self.window_s > 0, "RespawnPolicy.window_s (--respawn-window)", self.window_s, "must be > 0 seconds")
        check(self.min_uptime_s >= 0, "RespawnPolicy.min_uptime_s", self.min_uptime_s, "must be >= 0 seconds")


@dataclasses.dataclass(frozen=True)
class Decision:
    respawn: bool
    reason: str


def decide(policy: RespawnPolicy, exit_code: int, runs_wrapper: bool, killed_as_hung: Optional[bool],
           rank_starts: Sequence[float], node_starts: Sequence[float], now: float,
           returned: bool = False) -> Decision:
    """Replace the dead worker (respawn) or restart every worker, and why.

    `runs_wrapper`: the dead pid announced itself as running the Wrapper (respawn_marker);
    `killed_as_hung`: the node monitor took it down as hung (None: the monitor could not say);
    `rank_starts`: when this cycle's replacements of the rank started (the dead process is the
    last of them, if any); `node_starts`: when every replacement on this node started;
    `returned`: the worker had handed torch its return value already (it finished training)."""
    if exit_code == 0:
        return Decision(False, "it exited 0: a finished worker is never respawned")
    if exit_code in TERMINAL_EXIT_CODES:
        return Decision(False, f"exit code {exit_code} ({ExitCode(exit_code).name}) asks to stop, not to replace it")
    if exit_code == ExitCode.INPROCESS_GAVE_UP:
        return Decision(False, "the Wrapper gave up restarting in-process (exit 22): every rank restarts")
    if returned:
        return Decision(False, "it had returned its result already (it died waiting for the others to finish)")
    # (before the announcement: a replacement that dies as it starts has not joined, nor announced, yet)
    if rank_starts and now - rank_starts[-1] < policy.min_uptime_s:
        return Decision(False, f"it was a replacement and died {now - rank_starts[-1]:.1f} s after its start "
                        f"(min_uptime_s={policy.min_uptime_s:g})")
    if exit_code > 0:
        return Decision(False, f"it exited {exit_code}: an error the Wrapper did not handle in-process (only a "
                        "process killed by a signal is replaced)")
    if not runs_wrapper:
        return Decision(False, "the job does not use the Wrapper with respawn (this pid never announced itself)")
    if killed_as_hung is None:
        return Decision(False, "the node monitor could not say whether it killed the worker as hung")
    if killed_as_hung:
        return Decision(False, "the node monitor killed it as hung (a hang goes through restart-all)")
    recent = [t for t in node_starts if now - t < policy.window_s]
    if len(recent) >= policy.max_respawns:
        return Decision(False, f"the respawn budget is spent: {len(recent)} respawn(s) on this node within "
                        f"{policy.window_s:g} s (max_respawns={policy.max_respawns})")
    return Decision(True, "a Wrapper worker died; its peers wait for its replacement")


@dataclasses.dataclass(frozen=True)
class Respawned:
    """One replacement, as the agent and the events file hear of it."""

    rank: int
    local_rank: int
    old_pid: int
    new_pid: int
    incarnation: int
    exit_code: int
    seconds: float
    """From the death being seen to the replacement process started."""


class WorkerRespawner:
    """Replaces the dead workers of one restart cycle (module docstring).

    `lock` is shared with the agent's poll: both call handle_exits() under it. `node_starts` is
    the agent's list of replacement start times on this node (across cycles: the budget's);
    `hung_pids()` asks the node monitor which pids it killed as hung (None: it could not say);
    `replaced(record)` tells the agent, under the lock, that a worker has a new process."""

    def __init__(self, workers: WorkerProcesses, ranks: Dict[int, int], policy: RespawnPolicy,
                 respawn_dir: Optional[str], node_starts: List[float], hung_pids: Callable[[], Optional[Set[int]]],
                 replaced: Callable[[Respawned], None], events: ev.EventLog, cycle: int,
                 clock: Callable[[], float] = time.monotonic):
        self.lock = threading.Lock()
        self._workers = workers
        self._ranks = ranks
        self._policy = policy
        self._dir = respawn_dir
        self._node_starts = node_starts
        self._hung_pids = hung_pids
        self._replaced = replaced
        self._events = events
        self._cycle = cycle
        self._clock = clock
        self._envs = {local_rank: dict(env) for local_rank, env in workers.envs.items()}
        self._incarnations = {local_rank: 0 for local_rank in self._envs}
        self._rank_starts: Dict[int, List[float]] = {local_rank: [] for local_rank in self._envs}
        self._handled: set = set()
        """Processes whose exit was dealt with (replaced, or left to torch's poll)."""
        self._retired: list = []
        """Replaced processes, kept until the watcher ends: dropping one would close its sentinel,
        which the watcher's current wait may still hold."""
        self._group_kills: List[threading.Timer] = []
        self._closed = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._watch, name="nvrx-respawn-watcher", daemon=True)

    # ---- the exit watcher ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Respawn nothing from now on (the caller may hold `lock`): torch's poll has seen the
        cycle end, or the agent is about to stop the workers."""
        self._closed.set()
        self._wake()

    def stop(self) -> None:
        """close(), then wait for the watcher to end. Never call it holding `lock`."""
        self.close()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self.lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
            self._retired.clear()
        for timer in self._group_kills:  # the agent kills every worker group now anyway
            timer.cancel()

    def _wake(self) -> None:
        """Make the watcher look again (closed, or the process list changed)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full (a wakeup is pending anyway) or closed (stopped)
            pass

    def _watch(self) -> None:
        try:
            while True:
                with self.lock:
                    if self._closed.is_set():
                        return
                    watched = [p.sentinel for p in self._workers.processes if p not in self._handled]
                    wake = self._wake_r
                ready = multiprocessing.connection.wait([*watched, wake])
                if wake in ready:
                    while _read_some(wake):
                        pass
                with self.lock:
                    if self._closed.is_set():
                        return
                    self.handle_exits()
        except Exception:  # the agent's poll still handles every exit, without this thread's head start
            logger.exception("the respawn watcher failed; dead workers are handled at the agent's next poll")

    # ---- one exit ------------------------------------------------------------------------
    def handle_exits(self) -> None:
        """Deal with every worker that exited since the last look, without waiting (the caller
        holds `lock`): an exit 0 is left as it is, any other is replaced or left to torch."""
        if self._closed.is_set():
            return
        for local_rank, process in enumerate(list(self._workers.processes)):
            if process in self._handled:
                continue
            code = process.exitcode
            if code is None:
                continue
            self._handled.add(process)
            if code == 0:
                logger.info("rank %d (pid %d) exited 0; left as it is", self._ranks.get(local_rank, local_rank),
                            process.pid)
                continue
            self._died(local_rank, process, code)

    def _died(self, local_rank: int, process, code: int) -> None:
        seen = self._clock()
        rank = self._ranks.get(local_rank, local_rank)
        announced = wrapper_pid(self._dir, rank) if self._dir else None
        decision = decide(self._policy, code, runs_wrapper=announced == process.pid,
                          killed_as_hung=self._killed_as_hung(process.pid), rank_starts=self._rank_starts[local_rank],
                          node_starts=self._node_starts, now=seen, returned=self._returned(local_rank))
        if decision.respawn:
            try:
                new = self._start_replacement(local_rank, process)
            except Exception as e:  # the fork server gone, no memory for a process ...
                logger.exception("the replacement of rank %d could not start", rank)
                decision = Decision(False, f"its replacement could not start ({type(e).__name__}: {e})")
            else:
                self._replacement_started(local_rank, rank, process, new, code, seen)
                return
        logger.warning("rank %d (pid %d) exited %s and is not respawned: %s; every worker restarts",
                       rank, process.pid, code, decision.reason)
        self._events.emit(ev.RESPAWN_DECLINED, cycle=self._cycle, rank=rank, local_rank=local_rank,
                          pid=process.pid, exit_code=code, reason=decision.reason)

    def _killed_as_hung(self, pid: int) -> Optional[bool]:
        hung = self._hung_pids()
        return None if hung is None else pid in hung

    def _returned(self, local_rank: int) -> bool:
        queue = self._workers.ret_vals.get(local_rank)
        return local_rank in self._workers.returned or (queue is not None and not queue.empty())

    def _start_replacement(self, local_rank: int, old):
        """A new process for `local_rank`, in place of `old` from now on (torch's poll waits on it,
        never on the dead one)."""
        env = self._envs[local_rank]
        env[INCARNATION_ENV] = str(self._incarnations[local_rank] + 1)
        # What the dead worker left where its replacement writes (torch's error record, the
        # redirected output, which torch opens truncating) is kept beside it, named by its pid.
        workers = self._workers
        for path in (env.get(ELASTIC_ERROR_FILE_ENV), workers.stdouts.get(local_rank), workers.stderrs.get(local_rank)):
            _set_aside(path, old.pid)
        new, error_file = start_worker_process(workers, local_rank, self._envs)
        workers.processes[local_rank] = new
        old_error_file, workers.error_files[local_rank] = workers.error_files[local_rank], error_file
        workers.sentinels.pop(old.sentinel, None)
        workers.sentinels[new.sentinel] = local_rank
        self._retired.append(old)
        _remove(old_error_file)
        return new

    def _replacement_started(self, local_rank: int, rank: int, old, new, code: int, seen: float) -> None:
        started = self._clock()
        # Not at once: the dead worker's in-process monitor (a child in its group) is declaring
        # the death in the Wrapper's store, and a kill halfway through leaves a claim unfinished.
        timer = threading.Timer(DEAD_GROUP_GRACE_S, _kill_group, (old.pid, new.pid))
        timer.daemon = True
        timer.start()
        self._group_kills.append(timer)
        self._incarnations[local_rank] += 1
        self._rank_starts[local_rank].append(started)
        self._node_starts[:] = [t for t in self._node_starts if started - t < self._policy.window_s] + [started]
        record = Respawned(rank=rank, local_rank=local_rank, old_pid=old.pid, new_pid=new.pid,
                           incarnation=self._incarnations[local_rank], exit_code=code,
                           seconds=round(started - seen, 4))
        try:
            self._replaced(record)
        except Exception:  # the replacement runs: the agent's bookkeeping is what failed
            logger.exception("the agent could not record rank %d's replacement (pid %d)", rank, new.pid)
        logger.warning("rank %d (pid %d) exited %s; respawned it as pid %d (incarnation %d) in %.3f s; "
                       "its peers keep running", rank, old.pid, code, new.pid, record.incarnation, record.seconds)
        self._events.emit(ev.RANK_RESPAWNED, cycle=self._cycle, **dataclasses.asdict(record))
        self._wake()  # the watcher waits on the new process from now on


def _read_some(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def _set_aside(path: Optional[str], pid: int) -> None:
    if path and os.path.exists(path):
        try:
            os.replace(path, f"{path}.pid{pid}")
        except OSError as e:
            logger.warning("could not keep %s of the dead worker (pid %d): %s", path, pid, e)


def _remove(path: Optional[str]) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


DEAD_GROUP_GRACE_S = 2.0
"""How long what a dead worker started may outlive it before its group is killed."""


def _kill_group(pgid: int, replacement: int) -> None:
    """What the dead worker started (it led a process group of its own: data loader workers,
    its own fork servers) must not run beside its replacement, holding memory or devices.
    The group is killed with the cycle's others too (kill_process_groups) at the cycle's end."""
    if pgid != replacement and pgid > 1 and pgid != os.getpgrp():
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


check_worker_respawn()
