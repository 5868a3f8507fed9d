"""A worker for the late-join test: waits in a too-small world, finishes in the full one.

Each worker writes --out/started.<node>.<cycle>.rank<R> (its world size) when its process
group is up. In a world smaller than --world the job waits for the late node (the launcher
stops these workers when the node joins); in the full world every rank sums ones over the
group and writes --out/done.rank<R>.json. <node> is NVRX_TEST_NODE, set per launcher.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

from nvrx_core.durable import atomic_write_json

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--world", type=int, required=True)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
node, cycle = os.environ["NVRX_TEST_NODE"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
atomic_write_json(os.path.join(args.out, f"started.{node}.{cycle}.rank{rank}"), {"world": world})
if world < args.world:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # stopped by the launcher when the late node joins
        time.sleep(0.05)
    raise SystemExit(f"rank {rank}: the late node never joined")
total = torch.ones(1)
dist.all_reduce(total)
atomic_write_json(os.path.join(args.out, f"done.rank{rank}.json"),
                  {"node": node, "world": world, "sum": int(total.item()), "cycle": int(cycle)})
dist.destroy_process_group()
