"""Hugging Face adapter: what NVRxFaultTolerance costs per step, and how fast a killed rank's
Trainer job is back.

    .venv/bin/python bench/hf.py [--peer-python PATH] [--runs 5] [--restart-runs 3] [--only overhead|restart]

(A script's folder comes first on sys.path, so a bench/<name>.py stands in for a package of
that name in every job started from bench/; there is no `hf` package, unlike `lightning`.)

1. Overhead: a 2-rank CPU Trainer run (bench/_hf_job.py) under ft_launcher, steps paced to
   50 ms and to 5 ms by a sleep in the model's forward, with nvrx_hf's NVRxFaultTolerance
   against the same run with no callback. Figure: median step interval after 10 warm-up
   steps, median over --runs runs, the two kinds interleaved.
2. Restart: rank 1 SIGKILLed at step 15 (the Trainer saves every 10 steps; a restarted rank
   resumes from get_last_checkpoint) -> first step completed by a restarted rank. Ours:
   ft_launcher with warm start, transformers preloaded into its fork server
   (--warm-start-preload transformers.trainer,nvrx_hf) and NVRxFaultTolerance; peer: torchrun
   (`python -m torch.distributed.run --max-restarts 1`, no callback) on the same script.
A run whose restarted ranks never complete a step (the launcher gave up) counts as not
recovered; the medians are over the recovered runs, and the line says how many there were.
nvidia-resiliency-ext 0.4.1 has no Hugging Face callback, so --peer-python is accepted (the
Makefile passes it to every bench) and not used.

Prints `name: ours X, peer(...) Y, ratio Z` lines.
"""

import argparse
import os
import sys

import _adapter_bench as bench

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_hf_job.py")
FT_FLAGS = ["--ft-initial-rank-heartbeat-timeout", "120", "--ft-rank-heartbeat-timeout", "30"]
PRELOAD = ["--warm-start-preload", "transformers.trainer,nvrx_hf"]


def launcher(name: str) -> list:
    if name == "ours":
        return [sys.executable, "-m", "nvrx_core.ft.command", "--nproc-per-node", "2", "--max-restarts", "2",
                *FT_FLAGS, *PRELOAD, JOB]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1", JOB]


def run(name: str, job_args: list) -> tuple:
    return bench.run_job(f"hf-{name}", launcher(name), job_args, limit=300, env={"HF_HUB_OFFLINE": "1"})


def restart(runs: int) -> None:
    measured = bench.kill_recoveries(run, {"ours": "ours", "torchrun": "none"}, runs)
    (ours, ours_n), (peer, peer_n) = (bench.median_of_recovered(measured[n]) for n in ("ours", "torchrun"))
    print(f"hf_restart_kill: ours {ours:.2f} s ({ours_n}/{runs} recovered), peer(torchrun) {peer:.2f} s "
          f"({peer_n}/{runs} recovered), ratio {ours / peer:.2f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer-python", default="", help="accepted for the Makefile; not used (see the docstring)")
    parser.add_argument("--runs", type=int, default=5, help="overhead runs of each kind")
    parser.add_argument("--restart-runs", type=int, default=3)
    parser.add_argument("--only", choices=("overhead", "restart"), default=None)
    args = parser.parse_args()
    if args.only in (None, "overhead"):
        bench.overhead(run, "hf_overhead", 0.05, 150, args.runs)
        bench.overhead(run, "hf_overhead", 0.005, 600, args.runs)
    if args.only in (None, "restart"):
        restart(args.restart_runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
