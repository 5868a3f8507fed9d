"""Multi-node: losing a node, and one rendezvous round at scale; ours vs torchrun's c10d.

1. Node lost -> first step after recovery. Three launcher agents on this machine, each its
   own node (nvrx_core.demo.nodes), 2 ranks each, the demo job (50 ms steps, checkpoint every
   10). The whole process tree of a node that does not host the store is SIGKILLed after a
   checkpoint; the figure is the time from the kill to the first step done after training
   resumed. Same flags for both launchers:
     spare:   --nnodes 2, the third agent waits (ours: hot spare; torch: its redundancy list)
     elastic: --nnodes 2:3, all three train; the job goes on with two
   torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as ft_launcher does.
2. Rendezvous scale: one round of N agents simulated as threads with a store client each,
   spread over processes of 64 agents at most (bench/_rdzv_scale.py), ours vs torch's dynamic
   c10d handler on the same kind of store.

    python bench/multinode.py [--runs 3] [--scale 64,256,1024] [--skip-scale] [--peer-scale-max 256]

Prints `node_lost_<scenario>: ours X s, peer(torchrun) Y s, ratio Z` and
`rendezvous_<N>_nodes: ours X s, peer(torch c10d) Y s, ratio Z` lines (medians).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from nvrx_core.demo.nodes import FT_LAUNCHER, TORCHRUN, LocalCluster, checkpoint_after, first_step_after, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = {"spare": "2", "elastic": "2:3"}
LIMIT = 150.0  # seconds a launcher gets to recover before the run counts as "never"


def job(workdir: str):
    return ["-m", "nvrx_core.demo.train", "--steps", "3000", "--step-time", "0.05", "--ckpt-every", "10",
            "--ckpt-dir", os.path.join(workdir, "ckpt")]


def node_loss_once(launcher: str, scenario: str) -> float:
    workdir = tempfile.mkdtemp(prefix=f"nvrx-bench-nodes-{launcher}-")
    command = FT_LAUNCHER if launcher == "ours" else TORCHRUN
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if launcher == "torchrun" else {}
    try:
        with LocalCluster(workdir, job(workdir), nnodes=SCENARIOS[scenario], launcher=command,
                          flags=["--max-restarts", "3"], env=env) as cluster:
            a, b = cluster.start("a"), cluster.start("b")
            if scenario == "spare":  # a and b train; then the spare arrives
                wait_for(lambda: checkpoint_after(cluster.nodes, 0), 120, "training")
            third = cluster.start("c")
            wait_for(lambda: checkpoint_after(cluster.nodes, 0), 120, "training")
            settled = time.time() + 5  # the third agent has joined (or is waiting) by then
            wait_for(lambda: checkpoint_after(cluster.nodes, settled), 60, "a checkpoint after settling")
            killed_at = time.time()
            b.kill()
            try:
                back = wait_for(lambda: first_step_after([a, third], killed_at), LIMIT, "training back", poll=0.1)
            except TimeoutError:
                return float("inf")
            return back - killed_at
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def bench_node_loss(runs: int) -> None:
    for scenario in SCENARIOS:
        medians = {}
        for launcher in ("ours", "torchrun"):
            times = [node_loss_once(launcher, scenario) for _ in range(runs)]
            print(f"  {launcher:8s} {scenario:7s} runs: {[round(t, 2) for t in times]}", flush=True)
            medians[launcher] = statistics.median(times)
        ours, peer = medians["ours"], medians["torchrun"]
        print(f"node_lost_{scenario}: ours {ours:.2f} s, peer(torchrun) {peer:.2f} s, ratio {ours / peer:.2f}",
              flush=True)


CONNECT_LIMIT = 900.0  # connecting the simulated agents (bench/_rdzv_scale.py says why it is slow here)


def rendezvous_round(impl: str, nodes: int, limit: float) -> float:
    """One round's seconds (inf past `limit`); connecting the agents is not part of it."""
    cmd = [sys.executable, os.path.join(HERE, "_rdzv_scale.py"), impl, str(nodes), "auto", str(limit)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=limit + CONNECT_LIMIT).stdout
    except subprocess.TimeoutExpired:
        print(f"  {impl} {nodes}: agents not connected in {CONNECT_LIMIT:.0f} s", flush=True)
        return float("inf")
    report = json.loads(out.strip().splitlines()[-1])
    print(f"  {impl} {nodes}: round {report['seconds']} s, connecting {report['connect_seconds']:.1f} s"
          + (f", errors {report['errors']}" if report["errors"] else ""), flush=True)
    return float("inf") if report["seconds"] is None else report["seconds"]


def bench_scale(sizes, runs: int, limit: float, peer_max: int) -> None:
    curve = {}
    for n in sizes:
        ours = statistics.median([rendezvous_round("ours", n, limit) for _ in range(runs)])
        peer = statistics.median([rendezvous_round("torch", n, limit) for _ in range(runs)]) if n <= peer_max else None
        curve[n] = ours
        if peer is None:
            print(f"rendezvous_{n}_nodes: ours {ours:.3f} s, peer(torch c10d) not run (--peer-scale-max)", flush=True)
            continue
        if peer != float("inf"):
            peer_text, ratio = f"{peer:.3f} s", f"{ours / peer:.3f}"
        else:
            peer_text, ratio = f"> {limit:.0f} s (not finished)", f"< {ours / limit:.3f}"
        print(f"rendezvous_{n}_nodes: ours {ours:.3f} s, peer(torch c10d) {peer_text}, ratio {ratio}", flush=True)
    ordered = sorted(curve)
    for small, large in zip(ordered, ordered[1:]):
        print(f"  ours x{large / small:g} nodes -> x{curve[large] / curve[small]:.2f} time", flush=True)
    print("  ours per node: " + ", ".join(f"{n}: {1000 * curve[n] / n:.2f} ms" for n in ordered), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scale", default="64,256,1024", help="agent counts of the rendezvous-round figure")
    parser.add_argument("--scale-limit", type=float, default=420.0,
                        help="seconds one simulated round may take (connecting the agents not included)")
    parser.add_argument("--peer-scale-max", type=int, default=1 << 30,
                        help="run torch's handler only up to this many agents (it took > 420 s at 1024)")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--skip-node-loss", action="store_true")
    parser.add_argument("--peer-python", default=None, help="unused: the peers here are torch's own")
    args = parser.parse_args()
    if not args.skip_node_loss:
        bench_node_loss(args.runs)
    if not args.skip_scale:
        bench_scale([int(n) for n in args.scale.split(",")], args.runs, args.scale_limit, args.peer_scale_max)
    return 0


if __name__ == "__main__":
    sys.exit(main())
