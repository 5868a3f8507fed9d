"""Structured event log: one JSON object per line, shared by every part of nvrx-suite.

An incident report needs one timeline across the launcher, the node monitor and every
rank, so they all append to the same file (named by NVRX_EVENTS_FILE, which ft_launcher
sets for its workers). Each record carries wall time, rank, node and restart cycle, and the
launcher process it belongs to (NVRX_LAUNCHER_ID, which each ft_launcher sets afresh for its
monitor and workers): every attempt of a requeued Slurm job appends to the same file, each
counting restart cycles from 0, and the nodes of a one-host test cluster share a host name.

Appends use O_APPEND and a single write() per line, so lines from concurrent processes do
not interleave. Readers skip lines that do not parse (a writer killed mid-line).

Observability never disables safety: the launcher, the node monitor and the in-process
monitor all emit events on the paths that detect and recover from faults, so a file that
cannot be written (disk full, unwritable path, /dev/full) must not raise. Such an EventLog
warns once, then logs each event it could not write (logger "nvrx.events", INFO) and keeps
trying the file, so writes resume when the disk has room again.
"""

import json
import logging
import os
import socket
import time
import uuid
from typing import Any, Callable, Optional

from nvrx_core import dist_env

EVENTS_FILE_ENV = "NVRX_EVENTS_FILE"
LAUNCHER_ID_ENV = "NVRX_LAUNCHER_ID"
EVENTS_FORMAT = 1
"""Each record's "v": a reader meeting a newer one says so and reads what it understands."""

logger = logging.getLogger("nvrx.events")

# Every event kind nvrx-suite emits, in this one module so that readers of an events file
# (nvrx report) need no part's module, and so no torch.
FAULT_DETECTED = "fault_detected"
RANK_KILLED = "rank_killed"
STACKS_DUMPED = "stacks_dumped"
RANK_DISCONNECTED = "rank_disconnected"  # a rank's monitor connection closed without a goodbye: it died
WORKERS_FAILED = "workers_failed"
RESTART_BEGUN = "restart_begun"
RENDEZVOUS_DONE = "rendezvous_done"
WORKERS_STARTED = "workers_started"
TRAINING_RESUMED = "training_resumed"
TRAINING_FINISHED = "training_finished"
LAUNCHER_STARTED = "launcher_started"  # process_started: when the launcher process began (wall time)
LAUNCHER_EXIT = "launcher_exit"  # exit_code (the table's); process_exit_code: what the process exited with
LAUNCHER_SIGNALED = "launcher_signaled"  # a stop signal from outside (the scheduler): the workers' exits, preempted?
HEALTH_CHECK = "health_check"
TIMEOUTS_UPDATED = "timeouts_updated"
CHECKPOINT_COMMITTED = "checkpoint_committed"
CHECKPOINT_FAILED = "checkpoint_failed"  # a save did not become durable: step, generation, error (path / tier)
CHECKPOINT_ABORTED = "checkpoint_aborted"  # abort() stopped a save in flight and deleted its partial output
CHECKPOINT_SKIPPED = "checkpoint_skipped"  # a load passed over a corrupt or partial checkpoint: step, reason
CHECKPOINT_LOADED = "checkpoint_loaded"  # the local checkpoint manager loaded: step, source (local, replica, global)
STRAGGLER_FOUND = "straggler_found"
STRAGGLER_SCORES = "straggler_scores"  # rank 0, every complete report: {rank: relative score} (the heatmap)
STEP_DONE = "step_done"
FIRST_PROGRESS = "first_progress"  # the node monitor saw a cycle's first heartbeat / section end
FAULT_INJECTED = "fault_injected"
MONITOR_RESTARTED = "monitor_restarted"  # ft_launcher restarted a node monitor that died
NODE_LOST = "node_lost"  # a node's agent stopped its rendezvous heartbeat; its slot is free
SPARE_WAITING = "spare_waiting"  # a node found the round full and waits as a hot spare
SPARE_ACTIVATED = "spare_activated"  # a spare took the slot (group rank) of a lost node
WORKLOAD_REQUEST = "workload_request"  # a rank asked the launcher to stop the job or leave it at the next failure
RANK_RESPAWNED = "rank_respawned"  # respawn-rank: a dead worker replaced in place, its peers kept running
RESPAWN_DECLINED = "respawn_declined"  # respawn-rank: a dead worker not replaced (reason); every worker restarts
WORKER_EXCEPTION = "worker_exception"  # a worker's uncaught exception: type, message, traceback (ft.uncaught)
HANG_EVIDENCE = "hang_evidence"  # node monitor, at a hang: each rank's process state (running, sleeping, stopped)
COLLECTIVES_REPORTED = "collectives_reported"  # a hung rank's answer: the collectives in flight per group
STACKS_REPORTED = "stacks_reported"  # a hung rank's Python stacks, sent to the node monitor before the kill
PREEMPTION_AGREED = "preemption_agreed"  # every rank agreed at a step that a preemption signal arrived
STRAGGLER_CLEARED = "straggler_cleared"  # a rank reported as a straggler before is no longer one
RERUN_RESULT_REJECTED = "rerun_result_rejected"  # the rerun state machine rejected a step's result (NaN, spike)
RERUN_DIAGNOSIS = "rerun_diagnosis"  # the rerun state machine's verdict: transient, persistent, or not reproducible
RERUN_EXIT_REQUESTED = "rerun_exit_requested"  # the rerun state machine asked the job to exit (to rerun elsewhere)
RERUN_DETERMINISM_STATS = "rerun_determinism_stats"  # report-stats mode: how far a rerun's results differed
INPROCESS_INTERRUPTED = "inprocess_interrupted"  # in-process restart: an iteration was interrupted (cause, by whom)
INPROCESS_ABORTED = "inprocess_aborted"  # in-process restart: the rank's process groups were aborted
INPROCESS_REASSIGNED = "inprocess_reassigned"  # in-process restart: the rank got a new rank in the next iteration
INPROCESS_RESTARTED = "inprocess_restarted"  # in-process restart: the wrapped function starts again
INPROCESS_COMPLETED = "inprocess_completed"  # in-process restart: the wrapped function returned (role)
INPROCESS_GAVE_UP = "inprocess_gave_up"  # in-process restart: no further iteration (reason)
INPROCESS_EXCLUDED = "inprocess_excluded"  # in-process restart: this rank was excluded from the next iteration
INPROCESS_RANK_TERMINATED = "inprocess_rank_terminated"  # in-process monitor process killed its rank (cause)
INPROCESS_REPLACEMENT_JOINED = "inprocess_replacement_joined"  # a replacement process joined a running job


def new_launcher_id() -> str:
    """A name for one launcher process, unique across hosts and Slurm attempts (pids repeat)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class EventLog:
    """Appends events to a JSON-lines file; with no path it only logs them (debug level)."""

    def __init__(
        self,
        path: Optional[str],
        *,
        rank: Optional[int] = None,
        node: Optional[str] = None,
        cycle: Optional[int] = None,
        source: Optional[str] = None,
        launcher: Optional[str] = None,
        clock: Callable[[], float] = time.time,
    ):
        self.path = path
        self.rank = rank
        self.node = node if node is not None else socket.gethostname()
        self.cycle = cycle
        self.source = source
        self.launcher = launcher if launcher is not None else os.environ.get(LAUNCHER_ID_ENV)
        self._clock = clock
        self._failing = False  # the last write failed: warned already, events go to the log
        if path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            except OSError as e:
                self._write_failed(e)

    @classmethod
    def from_env(cls, source: Optional[str] = None) -> "EventLog":
        """The event log of a worker process, as set up by ft_launcher (or a no-file log)."""
        return cls(
            os.environ.get(EVENTS_FILE_ENV),
            rank=dist_env.rank(optional=True),
            cycle=dist_env.restart_count(optional=True),
            source=source,
        )

    def emit(self, kind: str, **fields: Any) -> dict:
        record = {
            "time": self._clock(),
            "kind": kind,
            "v": EVENTS_FORMAT,
            "rank": fields.pop("rank", self.rank),
            "node": self.node,
            "cycle": fields.pop("cycle", self.cycle),
        }
        if self.source:
            record["source"] = self.source
        if self.launcher:
            record["launcher"] = self.launcher
        record.update(fields)
        try:
            line = json.dumps(record, default=str) + "\n"
        except (TypeError, ValueError) as e:  # e.g. a circular field: the event still counts
            line = json.dumps({k: repr(v) for k, v in record.items()}) + "\n"
            logger.warning("event %s has a field JSON cannot encode (%s); written with repr()", kind, e)
        logger.debug("event %s", line.rstrip())
        if self.path:
            self._append(line)
        return record

    def _append(self, line: str) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as e:
            self._write_failed(e)
            logger.info("event (not written to %s) %s", self.path, line.rstrip())
            return
        if self._failing:
            self._failing = False
            logger.warning("events file %s is writable again", self.path)

    def _write_failed(self, error: OSError) -> None:
        """Warn once per outage; the caller goes on (see the module docstring)."""
        if not self._failing:
            self._failing = True
            logger.warning("cannot write the events file %s (%s): events go to the log instead "
                           "(logger nvrx.events); fault detection and recovery are not affected", self.path, error)


def read_events(path: str) -> list:
    """All well-formed events in `path`, in file order; a missing file reads as no events."""
    events = []
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(record, dict) and "kind" in record:
                    events.append(record)
    except FileNotFoundError:
        pass
    return events
