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

    return launch(argv)


if __name__ == "__main__":
    sys.exit(main())
