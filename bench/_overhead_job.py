"""Times the FT client's hot-path calls inside a real launcher (ours or nvidia-resiliency-ext's).

Prints one line `RESULT {"heartbeat_us": ..., "section_us": ...}`: medians over batches of
calls, each batch timed as a whole (a single call is below the clock's useful resolution).
"""
import argparse
import json
import statistics
import time

p = argparse.ArgumentParser()
p.add_argument("--client", choices=("ours", "nvrx"), required=True)
p.add_argument("--batches", type=int, default=30)
p.add_argument("--batch", type=int, default=2000)
args = p.parse_args()

if args.client == "ours":
    from nvrx_core.ft.client import RankMonitorClient
else:
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
client = RankMonitorClient()
client.init_workload_monitoring()


def per_call_us(fn):
    samples = []
    for _ in range(args.batches):
        t0 = time.perf_counter()
        for _ in range(args.batch):
            fn()
        samples.append((time.perf_counter() - t0) / args.batch * 1e6)
    return statistics.median(samples)


def section():
    client.start_section("step")
    client.end_section("step")


per_call_us(client.send_heartbeat)  # warm up both paths (connections, caches)
result = {"heartbeat_us": per_call_us(client.send_heartbeat), "section_us": per_call_us(section)}
client.shutdown_workload_monitoring()
print("RESULT " + json.dumps(result), flush=True)
