"""One rendezvous round of N simulated agents: `python bench/_rdzv_scale.py IMPL N` prints seconds.

Each agent is a thread with a store client of its own and a rendezvous handler of IMPL
(`ours`: nvrx_core's barrier handler; `torch`: torch's dynamic c10d handler), all on one
TCPStore served by this process. The time is from the moment every thread is released to
the moment the last one has its rank. No training process is started: this measures the
rendezvous protocol and the store, which is what grows with the node count.
"""

import concurrent.futures
import datetime
import json
import sys
import threading
import time

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as torch_handler

from nvrx_core.ft.rendezvous import BarrierRendezvousHandler, BarrierSettings


def make_handler(impl: str, client: TCPStore, n: int):
    if impl == "ours":
        return BarrierRendezvousHandler(client, BarrierSettings("scale", n, n))
    params = RendezvousParameters("c10d", f"127.0.0.1:{client.port}", "scale", n, n, join_timeout="1200")
    return torch_handler(client, C10dRendezvousBackend(client, "scale"), params)


def main() -> int:
    impl, n = sys.argv[1], int(sys.argv[2])
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    timeout = datetime.timedelta(seconds=1200)
    # connecting is slow where the client's reverse DNS lookup times out: connect many at once
    with concurrent.futures.ThreadPoolExecutor(256) as pool:
        clients = list(pool.map(lambda _: TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout),
                                range(n)))
    handlers = [make_handler(impl, c, n) for c in clients]
    go = threading.Event()
    ranks, errors = [None] * n, []

    def agent(i: int) -> None:
        go.wait()
        try:
            ranks[i] = handlers[i].next_rendezvous().rank
        except Exception as e:  # reported below; the run then has no figure
            errors.append(repr(e))

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    start = time.monotonic()
    go.set()
    for t in threads:
        t.join()
    seconds = time.monotonic() - start
    ok = not errors and sorted(ranks) == list(range(n))
    print(json.dumps({"impl": impl, "nodes": n, "seconds": seconds if ok else None, "errors": errors[:3]}),
          flush=True)
    with concurrent.futures.ThreadPoolExecutor(256) as pool:  # agents leave together, as they would
        list(pool.map(lambda h: h.shutdown(), handlers))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
