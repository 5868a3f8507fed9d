"""One rendezvous round of N simulated agents: `python bench/_rdzv_scale.py IMPL N [PROCS [ROUND_LIMIT]]`
prints seconds (null past ROUND_LIMIT seconds) and how long the agents took to connect.

Each agent is a thread with a store client of its own and a rendezvous handler of IMPL
(`ours`: nvrx_core's barrier handler; `torch`: torch's dynamic c10d handler), all on one
TCPStore served by this process. The agents are spread over PROCS processes (default: one
per AGENTS_PER_PROCESS agents, at least 8): in one process, hundreds of Python threads measure
one interpreter lock more than the protocol (1024 agents over 8 processes took 1.1 s to
arrive; over 16, 0.44 s). The time is from the moment every agent is released to the moment the last
one has its rank. No training process is started: this measures the rendezvous protocol and
the store, which is what grows with the node count.

Connecting is timed apart because on this machine it is slow for a reason of the sandbox's:
each TCPStore client looks up its peer's name (a PTR query for 127.0.0.1, sent to DNS because
the IPv6 socket's v4-mapped address is not in /etc/hosts), and the resolver drops about one
query in 25, each drop a 5 s timeout. 1024 agents took 108-117 s to connect.
"""

import concurrent.futures
import datetime
import json
import subprocess
import sys
import threading
import time

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as torch_handler

from nvrx_core.ft.rendezvous import BarrierRendezvousHandler, BarrierSettings

TIMEOUT = datetime.timedelta(seconds=1200)
AGENTS_PER_PROCESS = 64


def make_handler(impl: str, client: TCPStore, n: int):
    if impl == "ours":
        return BarrierRendezvousHandler(client, BarrierSettings("scale", n, n))
    params = RendezvousParameters("c10d", f"127.0.0.1:{client.port}", "scale", n, n, join_timeout="1200")
    return torch_handler(client, C10dRendezvousBackend(client, "scale"), params)


def worker(impl: str, n: int, port: int, count: int, procs: int) -> int:
    """`count` agents of an n-node job: connect, wait for the go, rendezvous, report."""
    # connecting is slow where the client's reverse DNS lookup times out: connect many at once
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        clients = list(pool.map(lambda _: TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT),
                                range(count)))
    handlers = [make_handler(impl, c, n) for c in clients]
    control = clients[0]
    control.add("bench/ready", 1)
    control.wait(["bench/go"])
    ranks, errors, ends = [None] * count, [], [0.0] * count

    def agent(i: int) -> None:
        try:
            ranks[i] = handlers[i].next_rendezvous().rank
        except Exception as e:  # reported below; the run then has no figure
            errors.append(repr(e))
        ends[i] = time.time()

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"ranks": ranks, "errors": errors[:3], "end": max(ends)}), flush=True)
    control.add("bench/done", 1)  # nobody closes the rendezvous before every agent has its rank
    while control.add("bench/done", 0) < procs:
        time.sleep(0.05)
    with concurrent.futures.ThreadPoolExecutor(64) as pool:  # agents leave together, as they would
        list(pool.map(lambda h: h.shutdown(), handlers))
    return 0


def main() -> int:
    if sys.argv[1] == "--worker":
        return worker(*sys.argv[2:3], *map(int, sys.argv[3:7]))
    impl, n = sys.argv[1], int(sys.argv[2])
    procs = min(n, int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "auto"
                else max(8, -(-n // AGENTS_PER_PROCESS)))
    round_limit = float(sys.argv[4]) if len(sys.argv) > 4 else TIMEOUT.total_seconds()
    began = time.time()
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    counts = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", impl, str(n), str(server.port), str(c),
                                 str(procs)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for c in counts]
    while server.add("bench/ready", 0) < procs:
        if any(w.poll() is not None for w in workers):
            raise SystemExit("a simulated-agent process died while connecting")
        time.sleep(0.05)
    start = time.time()
    connect_seconds = start - began
    server.set("bench/go", "1")
    try:
        reports = [json.loads(w.communicate(timeout=max(0.1, start + round_limit - time.time()))[0]
                              .strip().splitlines()[-1]) for w in workers]
    except subprocess.TimeoutExpired:
        for w in workers:
            w.kill()
            w.wait()
        print(json.dumps({"impl": impl, "nodes": n, "processes": procs, "seconds": None,
                          "connect_seconds": connect_seconds, "errors": [f"not finished in {round_limit:g} s"]}))
        return 1
    ranks = sorted(r for report in reports for r in report["ranks"] if r is not None)
    errors = [e for report in reports for e in report["errors"]]
    ok = not errors and ranks == list(range(n))
    seconds = max(report["end"] for report in reports) - start
    print(json.dumps({"impl": impl, "nodes": n, "processes": procs, "seconds": seconds if ok else None,
                      "connect_seconds": connect_seconds, "errors": errors[:3]}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
