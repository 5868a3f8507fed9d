"""A worker for the preemption-under-ft_launcher test.

Trains nothing: each step is one tiny gloo all_reduce (so ranks stay in lockstep, as in
data-parallel training), then the preemption handler's agreed check every 2 steps. Each
rank writes its pid and step to --out/progress.rank<R> (the test signals that pid), and
on an agreed stop --out/report.rank<R>.json, then exits with ExitCode.PREEMPTED.
--no-handler: no preemption handler, as in a script that never asked for one (SIGTERM kills it).
"""
import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

from nvrx_core.durable import atomic_write_json
from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.preemption import DistributedSignalHandler, PreemptionConfig
from nvrx_core.signals import default_registry

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=20000)
p.add_argument("--no-handler", action="store_true")
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
client = RankMonitorClient()
client.init_workload_monitoring()
handler = None if args.no_handler else DistributedSignalHandler(PreemptionConfig(signals=["SIGTERM"],
                                                                                   check_every_n_steps=2)).install()
owner = default_registry().owner(signal.SIGTERM)
flag = torch.zeros(1)
for step in range(args.max_steps):
    dist.all_reduce(flag)
    client.send_heartbeat()
    atomic_write_json(os.path.join(args.out, f"progress.rank{rank}"), {"pid": os.getpid(), "step": step})
    if handler is not None and handler.should_stop(step):
        atomic_write_json(os.path.join(args.out, f"report.rank{rank}.json"), {
            "stopped_at": step, "signals": [signal.Signals(n).name for n in handler.received],
            "sigterm_owner": owner, "cycle": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))})
        client.shutdown_workload_monitoring()
        dist.destroy_process_group()
        handler.exit_preempted()
    time.sleep(0.01)  # pacing: the test signals a worker while it trains
raise SystemExit(f"rank {rank}: never preempted in {args.max_steps} steps")
