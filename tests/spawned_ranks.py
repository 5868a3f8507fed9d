"""Ranks as processes (from a preloaded fork server) around a TCPStore hosted by the test: each runs
`target(rank, world, store_port, out_dir)`; every one must exit 0 in time, none outlives the test."""

import time

import torch.distributed as dist

import warm_python


def run_spawned_ranks(target, world: int, out_dir: str, timeout: float = 120.0) -> None:
    ctx = warm_python.forkserver_context()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    procs = [ctx.Process(target=target, args=(r, world, store.port, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        assert not [p for p in procs if p.is_alive()], f"ranks still running after {timeout} s"
        assert [p.exitcode for p in procs] == [0] * world
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
