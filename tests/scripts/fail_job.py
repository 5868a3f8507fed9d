"""A worker for launcher tests: reports progress up to --progress-to, then exits with --exit-code.

--marker FILE is created (appended) each time a worker starts, so a test can prove that
no worker ran at all (config errors) or count the cycles.
"""
import argparse
import os
import sys

from nvrx_core.ft.client import RankMonitorClient

p = argparse.ArgumentParser()
p.add_argument("--exit-code", type=int, default=1)
p.add_argument("--progress-to", type=int, default=-1, help="report iterations 0..N before exiting")
p.add_argument("--marker", default=None)
p.add_argument("--fail-rank", type=int, default=None, help="only this rank fails; the others wait to be stopped")
p.add_argument("--raise-error", default=None, help="end with an uncaught RuntimeError(TEXT) instead")
args = p.parse_args()
if args.marker:
    with open(args.marker, "a") as f:
        f.write(f"{os.environ.get('RANK')}:{os.environ.get('TORCHELASTIC_RESTART_COUNT')}\n")
client = RankMonitorClient()
client.init_workload_monitoring()
for i in range(args.progress_to + 1):
    client.send_heartbeat()
    client.report_progress(i)
rank = int(os.environ.get("RANK", 0))
if args.fail_rank is not None and rank != args.fail_rank:
    import time
    time.sleep(120)  # stopped by the launcher when the failing rank exits
client.shutdown_workload_monitoring()
if args.raise_error:
    raise RuntimeError(args.raise_error)
sys.exit(args.exit_code)
