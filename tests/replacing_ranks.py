"""examples/respawn_ddp.py's ranks around a store this test holds, with a stand-in for
ft_launcher's respawn: a rank killed by a signal is started again (same rank, the next
NVRX_RANK_INCARNATION) at once, always. What the launcher decides is tested with the launcher
(test_ft_respawn_agent.py, test_respawn.py); here it is the Wrapper's side alone. Each rank,
first or replacement, is started by harness.ranks.start_rank; only the replacing is this file's."""

import dataclasses
import glob
import os
import sys
import time
from multiprocessing.connection import wait
from typing import Dict, List, Tuple

from harness.ranks import kill_ranks, start_rank
from harness.stores import host_store

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
WORLD = 4


def _rank_main(rank: int, world: int, port: int, workdir: str, argv: List[str], incarnation: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1",
                      NVRX_RESTART_POLICY="respawn-rank", NVRX_RESPAWN_DIR=os.path.join(workdir, "announced"),
                      NVRX_RANK_INCARNATION=str(incarnation),
                      NVRX_EVENTS_FILE=os.path.join(workdir, "events.jsonl"))
    os.setsid()  # as a launcher's worker: the test kills whatever a rank left behind by group
    sys.path.insert(0, EXAMPLES)
    import respawn_ddp

    sys.exit(respawn_ddp.main(argv))


@dataclasses.dataclass
class Result:
    workdir: str
    exits: List[Tuple[int, int, int]]
    """(rank, pid, exit code) in the order the processes ended."""
    respawns: int

    def steps(self, rank: int) -> List[Tuple[int, float, int]]:
        """(step, wall time, pid) of every step `rank` committed, in order."""
        with open(os.path.join(self.workdir, f"steps.rank{rank}")) as f:
            return [(int(s), float(t), int(p)) for s, t, p in (line.split() for line in f)]

    def weights(self) -> Dict[int, str]:
        found = {}
        for path in glob.glob(os.path.join(self.workdir, "weights.rank*")):
            with open(path) as f:
                found[int(path.rsplit("rank", 1)[1])] = f.read()
        return found

    def kill_times(self) -> List[float]:
        times = []
        for path in glob.glob(os.path.join(self.workdir, "killed.*")):
            with open(path) as f:
                times.append(float(f.read()))
        return sorted(times)


def run(workdir: str, *job_args: str, timeout: float = 120.0, max_respawns: int = 4) -> Result:
    os.makedirs(os.path.join(workdir, "announced"), exist_ok=True)
    argv = ["--workdir", workdir, *job_args]
    store = host_store()
    incarnations = {rank: 0 for rank in range(WORLD)}
    running = {}

    def start(rank: int) -> None:
        running[rank] = start_rank(_rank_main, rank, WORLD, store.port, workdir, (argv, incarnations[rank]))

    for rank in range(WORLD):
        start(rank)
    exits, respawns, deadline = [], 0, time.monotonic() + timeout
    try:
        while running and time.monotonic() < deadline:
            ready = wait([p.sentinel for p in running.values()], timeout=max(0.1, deadline - time.monotonic()))
            for rank, proc in list(running.items()):
                if proc.sentinel not in ready:
                    continue
                proc.join()
                exits.append((rank, proc.pid, proc.exitcode))
                del running[rank]
                if proc.exitcode < 0 and respawns < max_respawns:
                    respawns += 1
                    incarnations[rank] += 1
                    start(rank)
        assert not running, f"ranks {sorted(running)} still running after {timeout} s; exits {exits}"
    finally:
        kill_ranks(list(running.values()))
    return Result(workdir, exits, respawns)
