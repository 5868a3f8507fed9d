"""respawn-rank on ft_launcher's command line, and what its workers find in their environment.

`--ft-restart-policy respawn-rank` replaces a dead worker in place (nvrx_core.ft.respawn). A
replacement is a fork of the warm fork server running torch's worker body again, so the policy
needs a warm start: a cold start's workers (--no-warm-start, --no-python, another interpreter
named by $PYTHON_EXEC) and --run-path's function inside the agent have no such server, and are
refused before anything starts. The workers learn the policy from NVRX_RESTART_POLICY and where
to announce that they run the Wrapper from NVRX_RESPAWN_DIR (nvrx_core.ft.respawn_marker), a
private directory that lives as long as the launcher.
"""

import os
import shutil
import tempfile
from typing import Mapping, MutableMapping, Optional

from nvrx_core.config import check
from nvrx_core.ft.respawn import RespawnPolicy
from nvrx_core.ft.respawn_marker import (INCARNATION_ENV, LAUNCHER_POLICY_ENV, RESPAWN_DIR_ENV, RESPAWN_POLICY,
                                         RESTART_POLICY_ENV)


def add_arguments(group) -> None:
    defaults = RespawnPolicy()
    group.add_argument("--max-respawns", "--max_respawns", type=int, default=defaults.max_respawns,
                       help="respawn-rank: dead workers this node replaces in place within --respawn-window; "
                       "the next death restarts every worker")
    group.add_argument("--respawn-window", "--respawn_window", type=float, default=defaults.window_s, metavar="SECONDS",
                       help="respawn-rank: the sliding window of --max-respawns")


def policy_from_args(args, warm_start: bool) -> Optional[RespawnPolicy]:
    """The policy of --ft-restart-policy respawn-rank (None for any other policy); ConfigError
    for a launch that could not honour it."""
    if args.ft_restart_policy != RESPAWN_POLICY:
        return None
    for flag, given in (("--no-warm-start", not args.warm_start), ("--no-python", args.no_python),
                        ("--run-path", args.run_path)):
        check(not given, "--ft-restart-policy", RESPAWN_POLICY,
              f"cannot be used with {flag}: a replacement worker is forked from the warm fork server")
    check(warm_start, "--ft-restart-policy", RESPAWN_POLICY,
          "needs the warm fork server, and $PYTHON_EXEC names another interpreter (the workers start cold)")
    return RespawnPolicy(max_respawns=args.max_respawns, window_s=args.respawn_window)


def default_policy(environ: Mapping[str, str]) -> str:
    """--ft-restart-policy's default: $NVRX_FT_RESTART_POLICY, else any-failed."""
    return environ.get(LAUNCHER_POLICY_ENV) or "any-failed"


def clear_workers_environment(environ: MutableMapping[str, str]) -> None:
    """Without the policy, no worker may believe in it (a variable inherited from outside)."""
    for name in (RESTART_POLICY_ENV, RESPAWN_DIR_ENV, INCARNATION_ENV):
        environ.pop(name, None)


def prepare_workers_environment(environ: MutableMapping[str, str]) -> str:
    """Tell the workers about the policy (before they start: the launcher passes what its
    environment gained to warm workers) and create the announcements directory (0700): its path."""
    directory = tempfile.mkdtemp(prefix="nvrx-respawn-")
    os.chmod(directory, 0o700)
    environ[RESTART_POLICY_ENV] = RESPAWN_POLICY
    environ[RESPAWN_DIR_ENV] = directory
    environ[INCARNATION_ENV] = "0"  # a replacement's own value (torch's per-worker variables) wins over this
    return directory


def remove_directory(directory: Optional[str]) -> None:
    if directory:
        shutil.rmtree(directory, ignore_errors=True)
