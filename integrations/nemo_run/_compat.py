"""nemo_run, when installed: the plugins stay importable without it and fail in `setup`.

Megatron-Bridge's plugins do the same, so a config module naming a plugin loads on a
machine that only trains (and has no nemo_run)."""

from typing import Any

MISSING_NEMO_RUN = "nvrx_nemo_run's plugins need nemo_run: pip install 'nvrx-suite[nemo-run]'"

try:
    import nemo_run as run

    Plugin: Any = run.Plugin
    HAVE_NEMO_RUN = True
except ImportError:
    run = None
    Plugin = object
    HAVE_NEMO_RUN = False


def require_nemo_run() -> Any:
    """The nemo_run module; ImportError naming the extra to install when it is missing."""
    if not HAVE_NEMO_RUN:
        raise ImportError(MISSING_NEMO_RUN)
    return run
