"""A worker for the respawn-rank tests (tests/test_ft_respawn_agent.py), without torch.distributed.

Each process announces itself as running the Wrapper (when the launcher gave it NVRX_RESPAWN_DIR,
as the Wrapper does once it joined), writes the launcher's respawn variables to OUT/env.<pid>,
appends "<rank> <pid> <incarnation> <restart count>" to OUT/starts, then waits until OUT/go
exists and exits 0. Options make one rank misbehave.
"""
import argparse
import json
import os
import sys
import time

from nvrx_core.ft.respawn_marker import INCARNATION_ENV, RESPAWN_DIR_ENV, RESTART_POLICY_ENV, announce_wrapper

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--no-announce-rank", type=int, default=None, help="this rank never announces itself")
p.add_argument("--crash-replacements", action="store_true", help="a replacement exits 3 right after its start")
p.add_argument("--exit-early-rank", type=int, default=None, help="this rank's first process ends at once with exit 0")
p.add_argument("--heartbeats", action="store_true", help="heartbeat to the node monitor while waiting")
p.add_argument("--hang-rank", type=int, default=None, help="with --heartbeats: this rank stops them (cycle 0)")
args = p.parse_args()

rank = int(os.environ["RANK"])
incarnation = int(os.environ.get(INCARNATION_ENV, "-1"))
restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1"))
client = None
if args.heartbeats:
    from nvrx_core.ft.client import RankMonitorClient

    client = RankMonitorClient()
    client.init_workload_monitoring()
    client.send_heartbeat()
if os.environ.get(RESPAWN_DIR_ENV) and rank != args.no_announce_rank:
    announce_wrapper(os.environ[RESPAWN_DIR_ENV], rank, os.getpid())
with open(os.path.join(args.out, f"env.{os.getpid()}"), "w") as f:
    json.dump({name: os.environ.get(name) for name in (RESTART_POLICY_ENV, RESPAWN_DIR_ENV, INCARNATION_ENV)}, f)
fd = os.open(os.path.join(args.out, "starts"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
os.write(fd, f"{rank} {os.getpid()} {incarnation} {restart_count}\n".encode())
os.close(fd)

if args.crash_replacements and incarnation >= 1:
    sys.exit(3)
if rank == args.exit_early_rank and incarnation == 0:
    os._exit(0)  # gone for good, without handing torch a return value
hung = rank == args.hang_rank and restart_count == 0
go = os.path.join(args.out, "go")
while not os.path.exists(go):
    if client is not None and not hung:
        client.send_heartbeat()
    time.sleep(0.02)
if client is not None:
    client.shutdown_workload_monitoring()
