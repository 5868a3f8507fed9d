"""Exceptions of the in-process restart machinery."""

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
