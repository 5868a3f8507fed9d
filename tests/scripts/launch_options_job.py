"""A worker for tests/test_ft_torchrun_parity.py: records what its launcher gave it.

Joins the gloo group, all-reduces its rank (so a report proves the workers formed one group),
and writes --out/report.rank<R>.json: the variables the launcher sets per worker, its parent's
pid, the CPUs it may run on, and what a connection to $TORCHELASTIC_HEALTH_CHECK_PORT answered
(if set). It prints one line to stdout and one to stderr, each carrying a word a test can
filter on, and one line of each that carries neither. --hold: after the report, ignore SIGTERM
and wait to be killed (a stop that needs SIGKILL, so the launcher's grace is what a test measures).
"""
import argparse
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--hold", action="store_true")
p.add_argument("--env", action="append", default=[], help="another variable to report")
args = p.parse_args()


def health_answer():
    port = os.environ.get("TORCHELASTIC_HEALTH_CHECK_PORT")
    if port is None:
        return None
    try:
        with socket.create_connection(("127.0.0.1", int(port)), timeout=30) as conn:
            conn.settimeout(30)
            return conn.makefile().readline().strip()
    except OSError as e:
        return f"error: {type(e).__name__}"


dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([float(rank)])
dist.all_reduce(total)
report = {
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "rank_sum": int(total.item()),
    "health": health_answer(),
    "cpus": sorted(os.sched_getaffinity(0)),
    "env": {name: os.environ.get(name) for name in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "NVRX_LAUNCHER_PID", *args.env)},
}
print(f"rank {rank} apple on stdout", flush=True)
print(f"rank {rank} plain on stdout", flush=True)
print(f"rank {rank} banana on stderr", file=sys.stderr, flush=True)
print(f"rank {rank} plain on stderr", file=sys.stderr, flush=True)
dist.destroy_process_group()
if args.hold:  # before the report, which tells the test it may signal the launcher now
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
path = os.path.join(args.out, f"report.rank{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(report, f)
os.replace(path + ".tmp", path)
while args.hold:
    time.sleep(1)
