"""The `ft_launcher` command: starts the warm-start fork server, then the launcher.

Importing the launcher imports torch (about 1.5 s), and the fork server imports torch too.
This module imports neither, so the server's imports run beside the launcher's instead of
after them: a job's workers start about that much sooner. `python -m nvrx_core.ft.command`
is the same command.
"""

import sys
from typing import List, Optional

from nvrx_core.ft.warm_start import start_early


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    start_early(argv)
    from nvrx_core.ft.launcher import main as launch

    code = launch(argv)
    # The exit code is decided: a stop signal now (Slurm's warning can land while the launcher
    # tears down after training finished) must not turn it into 128 + signal.
    from nvrx_core.signals import ignore_stop_requests

    ignore_stop_requests("ft_launcher (exit code decided)")
    return code


if __name__ == "__main__":
    sys.exit(main())
