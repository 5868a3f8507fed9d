"""The Wrapper's side of `ft_launcher --ft-restart-policy respawn-rank`.

The launcher replaces a rank whose process died with a new process of the same rank, forked
from its warm fork server, and leaves the other ranks running. In the Wrapper that is one
more restart iteration in which nobody moves:
- the survivors go through the usual restart path (abort, barrier, plan); the plan keeps the
  dead rank's place and names it in `awaiting`, and each survivor then waits, bounded by
  respawn_timeout, until the replacement has joined;
- the replacement skips the first barrier (it is long past), waits until a plan awaits it,
  takes its rank's place in the store (one process generation on, so a late declaration about
  the process it replaces cannot end it) and runs that plan's iteration with the others;
- in the iteration, `RestartState.respawned` names the fresh ranks, and `roll_forward` brings
  them the state of a rank that kept its memory.

The launcher respawns only a process that announced itself here (`announce`): one that runs
training without the Wrapper could not rejoin, and dies into a restart of every rank.
"""

import logging
import os
import time
from typing import Dict, Mapping, Optional, Tuple

from nvrx_core.ft.respawn_marker import INCARNATION_ENV, RESPAWN_DIR_ENV, RESTART_POLICY_ENV, announce_wrapper
from nvrx_core.inprocess.coordination import Coordinator, Poller
from nvrx_core.inprocess.errors import InProcessGaveUp
from nvrx_core.inprocess.planning import Plan
from nvrx_core.inprocess.records import Cause

logger = logging.getLogger("nvrx.inprocess")

RESPAWN_POLICY = "respawn-rank"


def respawn_on(env: Mapping[str, str]) -> bool:
    """Whether the launcher replaces dead ranks (ft_launcher --ft-restart-policy respawn-rank)."""
    return env.get(RESTART_POLICY_ENV) == RESPAWN_POLICY


def incarnation(env: Mapping[str, str]) -> int:
    """0 for a rank's first process in a launcher cycle, n for its n-th replacement."""
    value = env.get(INCARNATION_ENV, "0") or "0"
    return int(value) if value.isdigit() else 0


def announce(env: Mapping[str, str], rank: int) -> None:
    """Tell the launcher this process runs the Wrapper, so it may be replaced if it dies."""
    directory = env.get(RESPAWN_DIR_ENV)
    if directory:
        announce_wrapper(directory, rank, os.getpid())


def generations(coord: Coordinator, marks: Mapping[int, str], out: Mapping[int, str]) -> Dict[int, int]:
    """The process generation of each newly dead rank (read before any replacement can join)."""
    return {rank: coord.generation(rank) for rank in marks if rank not in out}


def publish(coord: Coordinator, plan: Plan) -> None:
    """Let the replacements of plan.awaiting know which iteration they join (every survivor
    writes the same value)."""
    for rank, generation in plan.awaiting.items():
        coord.await_replacement(rank, generation, plan.iteration)


def join(coord: Coordinator, world_size: int, timeout: float) -> Tuple[Plan, list]:
    """This process replaces its rank: (the plan of the iteration it joins, the node names)."""
    generation = coord.generation(coord.rank)
    # The process replaced is dead (that is why this one runs). Its own monitor process says so
    # too, but may be killed with its group before it does: said here, peers never wait for it.
    coord.mark_terminated(coord.rank, Cause.EXITED, "its process died; the launcher started a replacement",
                          generation=generation)
    iteration = coord.awaited_at(generation, timeout)
    nodes = coord.node_names(world_size)
    plan = Plan.from_json(coord.wait_for_plan(iteration - 1, timeout), nodes)
    coord.revive()
    coord.heartbeat()
    logger.warning("rank %d: replacement (generation %d) joins iteration %d", coord.rank, generation + 1, iteration)
    return plan, nodes


def wait_for_replacements(coord: Coordinator, plan: Plan, timeout: float) -> Optional[str]:
    """Wait until every rank plan.awaiting has its replacement in place.

    Returns None when they joined, or why the iteration must restart instead (another rank
    died meanwhile). Raises InProcessGaveUp after `timeout` seconds: the launcher then
    restarts every rank.
    """
    if not plan.awaiting:
        return None
    deadline, poller = time.monotonic() + timeout, Poller()
    while True:
        terminated, declared = coord.terminations()
        if declared > plan.marked:
            return "a rank died while the others waited for replacements"
        missing = sorted(rank for rank in plan.awaiting if rank in terminated)
        if not missing:
            return None
        if time.monotonic() > deadline:
            raise InProcessGaveUp(f"no replacement of rank(s) {missing} joined within respawn_timeout={timeout} s")
        poller.wait()
