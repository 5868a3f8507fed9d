"""The one table of process exit codes used by every part of nvrx-suite.

Schedulers and launchers read these, so each meaning has exactly one number and none of
the "stop" codes is 0 (a scheduler reads 0 as "job finished, do not requeue").
"""

import enum


class ExitCode(enum.IntEnum):
    SUCCESS = 0
    """Training finished."""

    FAILURE = 1
    """Unrecoverable failure (a worker failed and no restart is left or allowed)."""

    CONFIG_ERROR = 2
    """Bad configuration or command line; nothing was started."""

    RERUN_RESUME_ELSEWHERE = 16
    """Rerun state machine: result reproduced on this device; checkpointed, resume on another."""

    RERUN_VALIDATION_FAILED = 17
    """Rerun state machine: validation failed for good: a fatal transient error, a result that
    reproduces on two devices (a genuine data/model problem), or a job that keeps landing on
    the suspect device."""

    PREEMPTED = 18
    """The scheduler preempted the job; a checkpoint was saved: requeue me."""

    STRAGGLER_STOP = 19
    """A straggler was detected and stop_if_detected is on; a checkpoint was saved."""

    NO_PROGRESS = 20
    """The launcher gave up: N consecutive restart cycles made no training progress."""

    RESTARTS_EXHAUSTED = 21
    """Workers kept failing and --max-restarts restart cycles were used up."""

    INPROCESS_GAVE_UP = 22
    """In-process restart stopped: max_iterations or max_rank_faults was reached."""

    MONITOR_LOST = 23
    """ft_launcher's node monitor kept dying (restarted too often in a short time): the job is
    stopped rather than left to train with no hang detection."""

    WORKLOAD_SHUTDOWN = 24
    """A rank asked to end the job (nvidia-resiliency-ext's ShutdownWorkload) and then it
    failed: no restart, and the rendezvous is closed, so every node ends."""

    NODE_EXCLUDED = 25
    """A rank asked to take its node out (ExcludeThisNode) and then it failed: this node's
    launcher leaves the job; the other nodes go on without it (a hot spare takes its place)."""


TERMINAL_EXIT_CODES = frozenset({
    ExitCode.RERUN_RESUME_ELSEWHERE, ExitCode.RERUN_VALIDATION_FAILED, ExitCode.PREEMPTED, ExitCode.STRAGGLER_STOP,
})
"""A worker's exit codes that ask for the job to stop: ft_launcher neither restarts nor respawns it."""

PREEMPTED_EXIT_CODE_ENV = "NVRX_PREEMPTED_EXIT_CODE"
"""When set, ft_launcher ends a preempted job (PREEMPTED) with this code instead: the one
place the table is mapped to a scheduler template's own convention (NeMo-Run's Slurm
template requeues a job only when it exits 0 unfinished; any other code counts as a failure)."""


def describe(code: int) -> str:
    """A human-readable name for an exit code, including codes not in the table."""
    try:
        return ExitCode(code).name
    except ValueError:
        if code < 0:
            return f"killed by signal {-code}"
        return f"exit code {code}"
