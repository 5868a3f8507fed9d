"""Ranks as processes (from a preloaded fork server) around a TCPStore hosted by the test.

The one rank spawner of the tests: `spawn_ranks` runs `target(rank, world, store_port, out_dir,
*args)` on `world` processes and returns their exit codes (none outlives the call);
`run_spawned_ranks` also requires every one to exit 0. `start_rank` starts one such process, for a
test that starts ranks again itself (tests/replacing_ranks.py: a killed rank's replacement).
`TorchrunLikeRanks` starts a script's ranks with torchrun's environment instead. The store is
harness.stores.host_store.
"""

import multiprocessing
import os
import subprocess
import time
from typing import Callable, List, Optional, Sequence

import pytest

import warm_python
from harness.stores import host_store
from harness.launcher import kill_tree


def start_rank(target: Callable, rank: int, world: int, store_port: int, out_dir: str,
               args: Sequence = ()) -> multiprocessing.Process:
    """One rank: a process running `target(rank, world, store_port, out_dir, *args)`, forked from the
    tests' fork server (torch imported once, warm_python.forkserver_context)."""
    ctx = warm_python.forkserver_context()
    proc = ctx.Process(target=target, args=(rank, world, store_port, str(out_dir), *args))
    proc.start()
    return proc


def spawn_ranks(target: Callable, world: int, out_dir: str, args: Sequence = (), timeout: float = 120.0, *,
                store_port: Optional[int] = None, during: Optional[Callable[[list], None]] = None,
                explain: Optional[Callable[[List[Optional[int]]], str]] = None) -> List[int]:
    """Every rank's exit code; the test fails if any is still running after `timeout` s (it is killed).

    store_port: a store held elsewhere (default: host_store, held here for the call, as ft_launcher's
    agent holds it, so it outlives any rank). during(procs): called once every rank started, to act
    on them meanwhile. explain(exit codes, the killed ranks' included): added to the failure."""
    store = None
    if store_port is None:
        store = host_store(world)
        store_port = store.port
    procs = [start_rank(target, r, world, store_port, out_dir, args) for r in range(world)]
    deadline = time.monotonic() + timeout
    try:
        if during is not None:
            during(procs)
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
    finally:
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        kill_ranks(procs)
    codes = [p.exitcode for p in procs]
    assert not hung, f"ranks {hung} still running after {timeout} s" + (f"\n{explain(codes)}" if explain else "")
    return codes


def kill_ranks(procs: Sequence[multiprocessing.Process]) -> None:
    """SIGKILL each rank still running and reap it."""
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def run_spawned_ranks(target: Callable, world: int, out_dir: str, timeout: float = 120.0, args: Sequence = ()) -> None:
    """spawn_ranks, and every rank must exit 0."""
    assert spawn_ranks(target, world, out_dir, args, timeout) == [0] * world


class TorchrunLikeRanks:
    """`world` ranks of one script started as torchrun starts them (RANK, LOCAL_RANK, WORLD_SIZE,
    the torchelastic variables, MASTER_* of a store this test holds, a log file each), forked
    from a warm process that imported `preload`. No launcher: the test signals ranks itself."""

    def __init__(self, out: str, argv: list, preload, world: int = 2, env: dict = None):
        os.makedirs(out, exist_ok=True)
        self.out = out
        self.store = host_store()
        self.procs = []
        base = {k: v for k, v in os.environ.items() if not k.startswith(("NVRX_", "FAULT_TOL_"))}
        base.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
        for rank in range(world):
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world),
                            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port),
                            TORCHELASTIC_RUN_ID="nvrx-test", TORCHELASTIC_USE_AGENT_STORE="True",
                            TORCHELASTIC_RESTART_COUNT="0")
            with open(os.path.join(out, f"rank{rank}.log"), "w") as log:
                self.procs.append(warm_python.popen(list(argv), env=rank_env, stdout=log, stderr=warm_python.STDOUT,
                                                    start_new_session=True, preload=preload))

    def finish(self, timeout: float = 150.0) -> list:
        """Every rank's exit code, once all exited within `timeout` (else the test fails)."""
        deadline = time.monotonic() + timeout
        try:
            for proc in self.procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"job in {self.out} did not finish within {timeout} s\n{self.logs()}")
        finally:
            self.kill()
        return [p.returncode for p in self.procs]

    def kill(self) -> None:
        for proc in self.procs:
            kill_tree(proc.pid)
            proc.wait()

    def logs(self) -> str:
        return "".join(tail(os.path.join(self.out, f"rank{r}.log")) for r in range(len(self.procs)))


def tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except FileNotFoundError:
        return ""
