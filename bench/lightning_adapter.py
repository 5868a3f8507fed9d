"""Lightning adapter: what the callbacks cost per step, and how fast a killed rank's job is back.

    .venv/bin/python bench/lightning_adapter.py [--peer-python .venv-peer/bin/python] [--runs 3]

(Not bench/lightning.py: a script's folder comes first on sys.path, so a bench/lightning.py
would stand in for the `lightning` package in every job started from bench/.)

1. Overhead: a 2-rank CPU DDP fit (bench/_lightning_job.py) under ft_launcher, steps paced
   to 50 ms and to 5 ms, with nvrx_lightning's callbacks (NVRxFaultTolerance,
   NVRxStragglerDetection, NVRxPreemption; NVRxAsyncCheckpointIO installed, its save cost is
   part 3) against the same fit with none. Figure: median step interval after 10 warm-up
   steps, median over runs, interleaved.
2. Restart: rank 1 SIGKILLed at step 15 (checkpoint every 10 steps, ckpt_path="last") ->
   first step completed by a restarted rank. Ours: ft_launcher with warm start, Lightning
   preloaded into its fork server (--warm-start-preload lightning.pytorch,nvrx_lightning) and
   NVRxFaultTolerance; peers: torchrun (no callback), nvidia-resiliency-ext 0.4.1's
   ft_launcher with its FaultToleranceCallback (when --peer-python has it).
How long a ModelCheckpoint save blocks the loop is bench/lightning_checkpoint.py's figure.

Prints `name: ours X, peer(...) Y, ratio Z` lines.
"""

import argparse
import os
import subprocess
import sys

import _adapter_bench as bench

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_lightning_job.py")
FT_FLAGS = ["--ft-initial-rank-heartbeat-timeout", "120", "--ft-rank-heartbeat-timeout", "30"]
PRELOAD = ["--warm-start-preload", "lightning.pytorch,nvrx_lightning"]


def launcher(name: str, peer_python: str) -> list:
    common = ["--nproc-per-node", "2", "--max-restarts", "2"]
    if name == "ours":
        return [sys.executable, "-m", "nvrx_core.ft.command", *common, *FT_FLAGS, *PRELOAD, JOB]
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *common, JOB]
    return [os.path.join(os.path.dirname(peer_python), "ft_launcher"), *common, *FT_FLAGS, JOB]


def runner(peer_python: str) -> bench.Run:
    return lambda name, job_args: bench.run_job(f"lightning-{name}", launcher(name, peer_python), job_args, 300)


def peer_has_callback(peer_python: str) -> str:
    """'' if nvidia-resiliency-ext's Lightning callback imports in the peer venv, else why not."""
    if not peer_python or not os.path.exists(peer_python):
        return "no nvidia-resiliency-ext venv given (--peer-python; `make peer` builds .venv-peer)"
    probe = subprocess.run([peer_python, "-c", "from nvidia_resiliency_ext.ptl_resiliency import FaultToleranceCallback"],
                           capture_output=True, text=True)
    return "" if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["import failed"])[-1]


def restart(peer_python: str, runs: int) -> None:
    callbacks_of = {"ours": "ours", "torchrun": "none"}
    why_not = peer_has_callback(peer_python)
    if why_not:
        print(f"  nvidia-resiliency-ext 0.4.1 not measured: {why_not}", flush=True)
    else:
        callbacks_of["nvrx"] = "peer"
    measured = bench.kill_recoveries(runner(peer_python), callbacks_of, runs)
    ours, _ = bench.median_of_recovered(measured["ours"])
    for name in callbacks_of:
        if name != "ours":
            peer, _ = bench.median_of_recovered(measured[name])
            label = "nvrx-0.4.1" if name == "nvrx" else name
            print(f"lightning_restart_kill: ours {ours:.2f} s, peer({label}) {peer:.2f} s, ratio {ours / peer:.2f}",
                  flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer-python", default="", help="python of the venv with nvidia-resiliency-ext 0.4.1")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", choices=("overhead", "restart"), default=None)
    args = parser.parse_args()
    if args.only in (None, "overhead"):
        bench.overhead(runner(args.peer_python), "lightning_overhead", 0.05, 150, args.runs)
        bench.overhead(runner(args.peer_python), "lightning_overhead", 0.005, 600, args.runs)
    if args.only in (None, "restart"):
        restart(args.peer_python, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
