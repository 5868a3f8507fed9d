"""Times the FT client's hot-path calls inside a real launcher (ours or nvidia-resiliency-ext's).

Prints one line `RESULT {"heartbeat_us": ..., "section_us": ..., "heartbeat_burst_us": ...,
"section_burst_us": ...}`: medians over batches of calls, each batch timed as a whole (a single
call is below the clock's useful resolution). Paced batches (100 calls, then a pause the
monitor uses to read them) are the realistic case, a call per training step: every message
is written to the socket. Burst batches call back to back, faster than any monitor reads;
there a client that never blocks mostly finds the socket full and only updates its own view.
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


def per_call_us(fn, batch=None, batches=None, pause=0.0):
    batch, samples = batch or args.batch, []
    for _ in range(batches or args.batches):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - t0) / batch * 1e6)
        time.sleep(pause)
    return statistics.median(samples)


def paced(fn):
    return per_call_us(fn, batch=100, batches=60, pause=0.01)


def section():
    client.start_section("step")
    client.end_section("step")


per_call_us(client.send_heartbeat)  # warm up both paths (connections, caches)
result = {"heartbeat_us": paced(client.send_heartbeat), "section_us": paced(section),
          "heartbeat_burst_us": per_call_us(client.send_heartbeat), "section_burst_us": per_call_us(section)}
client.shutdown_workload_monitoring()
print("RESULT " + json.dumps(result), flush=True)
