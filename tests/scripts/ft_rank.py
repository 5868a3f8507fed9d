"""A rank for node-monitor tests: a real RankMonitorClient in its own process, driven from stdin.

Commands, one per line: hb | ss NAME | se NAME | progress N | load DIR | bye |
on-sigterm-disconnect (from then on SIGTERM only disconnects; the process keeps running).
After each command it prints "ok CMD", so a test knows the call was made (and returned).
A rank that gets no more commands is idle, which the monitor sees as hung.
"""
import signal
import sys

from nvrx_core.ft.client import RankMonitorClient

client = RankMonitorClient()
client.init_workload_monitoring()
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "hb":
        client.send_heartbeat()
    elif cmd == "ss":
        client.start_section(args[0])
    elif cmd == "se":
        client.end_section(args[0])
    elif cmd == "progress":
        client.report_progress(int(args[0]))
    elif cmd == "load":
        client.load_state(args[0])
    elif cmd == "bye":
        client.shutdown_workload_monitoring()
    elif cmd == "on-sigterm-disconnect":
        signal.signal(signal.SIGTERM, lambda *_: client.shutdown_workload_monitoring())
    print("ok", cmd, flush=True)
