"""Exceptions of the in-process restart machinery, and what the Wrapper does with a failed iteration's error."""

import traceback

from nvrx_core.exit_codes import ExitCode


class RestartRequested(BaseException):
    """Raised asynchronously in the main thread to stop the wrapped function for a restart.

    A BaseException, so that `except Exception:` blocks in training code do not swallow it.
    """


class RestartError(RuntimeError):
    """The restart machinery itself cannot go on (the process should fail)."""


class BarrierTimeout(RestartError):
    """Ranks did not meet at a restart barrier within barrier_timeout."""


class RankExcluded(RestartError):
    """This rank was excluded from the job (failed a health check, or declared lost)."""


class InProcessGaveUp(SystemExit):
    """In-process restart stopped for good: max_iterations, max_rank_faults, or too few ranks.

    A SystemExit carrying ExitCode.INPROCESS_GAVE_UP (22): uncaught, the process ends with
    that code and no traceback, which launchers and schedulers read.
    """

    def __init__(self, reason: str):
        super().__init__(int(ExitCode.INPROCESS_GAVE_UP))
        self.reason = reason

    def __str__(self) -> str:
        return f"in-process restart gave up: {self.reason}"


def clear_frames(error: BaseException) -> None:
    """Drop the locals of every frame in the error's tracebacks, chained errors included.

    Those locals (a DDP model, a process group resolved inside torch.distributed) keep the
    failed iteration's groups alive. Freed here, while the Wrapper still holds the groups,
    their last reference dies in the reaper thread, not later in the main thread, where
    destroying a group whose gloo worker waits out its timeout would stall the rank.
    """
    pending, seen = [error], set()
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending += [error.__cause__, error.__context__]


def is_communication_error(error: BaseException) -> bool:
    """A collective that failed, most likely because another rank did (logged without a traceback)."""
    import torch.distributed as dist

    return isinstance(error, dist.DistError) or "gloo/transport" in str(error) or "NCCL" in str(error)
