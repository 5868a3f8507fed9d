"""The warm-start fork server's first preload: it ignores the signals that ask a job to stop.

Slurm's --signal (TERM@60 before a time limit or a preemption) reaches every process of the
job step, the fork server included, and a terminal's hang-up its whole group. multiprocessing's
fork server ignores only SIGINT; SIGTERM killed it, and that cost the job its save:
- its workers are started with PR_SET_PDEATHSIG = SIGINT (torch's multiprocessing wrapper),
  so they were interrupted the moment their parent died, before their preemption handler
  could save;
- the server is how the launcher learns its workers' exit statuses (it reaps them and writes
  each status to the launcher), so a worker that did save and exit PREEMPTED read as 255.
The server has nothing to decide on a stop request: the launcher decides, and the server ends
when the launcher does (its "alive" pipe closes: multiprocessing's own rule). Workers forked
from it set their dispositions back to a fresh interpreter's
(warm_start.become_like_a_fresh_interpreter), so a worker's own handler decides.

Preloaded before torch, so the server is protected during its own imports too. Importing it
anywhere but in multiprocessing's fork server does nothing (a test, a docs build).
"""

import sys

from nvrx_core.signals import ignore_stop_requests

OWNER = "warm-start fork server"


def imported_by_fork_server() -> bool:
    """Whether the import in progress runs inside multiprocessing's fork server main()."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return True
        frame = frame.f_back
    return False


if imported_by_fork_server():
    ignore_stop_requests(OWNER)  # held for the server's life: it exits, nothing to undo
