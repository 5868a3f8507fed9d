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
import json
import os
import shutil
import statistics
import sys
import tempfile

from _process import run_group

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_hf_job.py")
FT_FLAGS = ["--ft-initial-rank-heartbeat-timeout", "120", "--ft-rank-heartbeat-timeout", "30"]
PRELOAD = ["--warm-start-preload", "transformers.trainer,nvrx_hf"]
WARMUP_STEPS = 10


def launcher(name: str) -> list:
    if name == "ours":
        return [sys.executable, "-m", "nvrx_core.ft.command", "--nproc-per-node", "2", "--max-restarts", "2",
                *FT_FLAGS, *PRELOAD, JOB]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1", JOB]


def run_job(name: str, job_args: list, limit: float) -> tuple:
    workdir = tempfile.mkdtemp(prefix=f"nvrx-bench-hf-{name}-")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env.pop("NVRX_EVENTS_FILE", None)
    with open(os.path.join(workdir, "launcher.log"), "w") as log:
        code = run_group(launcher(name) + [*job_args, "--workdir", workdir], log, env, limit)
    records = []
    try:
        with open(os.path.join(workdir, "timeline.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        pass
    if code != 0:
        print(f"  {name} {' '.join(job_args)}: exit {code}; log kept in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return code, records


# ---- 1. overhead ---------------------------------------------------------------------------

def step_interval(records: list) -> float:
    intervals = []
    for rec in records:
        if rec["ev"] == "steps":
            ends = rec["ends"][WARMUP_STEPS:]
            intervals += [b - a for a, b in zip(ends, ends[1:])]
    return statistics.median(intervals) if intervals else float("nan")


def overhead(step_s: float, steps: int, runs: int) -> None:
    job = ["--step-time", str(step_s), "--steps", str(steps)]
    measured = {"ours": [], "none": []}
    for _ in range(runs):
        for callbacks in ("none", "ours"):
            code, records = run_job("ours", job + ["--callbacks", callbacks], limit=300)
            if code == 0:
                measured[callbacks].append(step_interval(records))
    ours = statistics.median(measured["ours"] or [float("nan")])
    plain = statistics.median(measured["none"] or [float("nan")])
    print(f"  step interval runs (ms): ours {[round(v * 1e3, 2) for v in measured['ours']]}, "
          f"none {[round(v * 1e3, 2) for v in measured['none']]}", flush=True)
    print(f"hf_overhead_{step_s * 1e3:g}ms_step: ours {ours * 1e3:.2f} ms, peer(no callback) "
          f"{plain * 1e3:.2f} ms, ratio {ours / plain:.3f} (cost {100 * (ours / plain - 1):+.2f}%)", flush=True)


# ---- 2. restart ------------------------------------------------------------------------------

def recovery(records: list):
    """Seconds from the kill to the first step a process started after it completed."""
    fault = next((r["t"] for r in records if r["ev"] == "fault"), None)
    if fault is None:
        return None
    restarted = {r["pid"] for r in records if r["ev"] == "started" and r["t"] > fault}
    after = [r["t"] for r in records if r["ev"] == "step" and r["pid"] in restarted]
    return min(after) - fault if after else None


def restart(runs: int) -> None:
    job = ["--fault", "kill", "--fault-step", "15", "--steps", "30", "--checkpoint-every", "10",
           "--step-time", "0.05", "--record-each-step"]
    names = {"ours": "ours", "torchrun": "none"}
    measured = {name: [] for name in names}
    for _ in range(runs):
        for name, callbacks in names.items():
            _, records = run_job(name, job + ["--callbacks", callbacks], limit=300)
            measured[name].append(recovery(records))
    for name, values in measured.items():
        print(f"  {name:10s} kill -> first step after restart (s): "
              f"{[round(v, 2) if v is not None else None for v in values]}", flush=True)
    ours, peer = ([v for v in measured[name] if v is not None] for name in ("ours", "torchrun"))
    ours_s = statistics.median(ours) if ours else float("nan")
    peer_s = statistics.median(peer) if peer else float("nan")
    print(f"hf_restart_kill: ours {ours_s:.2f} s ({len(ours)}/{runs} recovered), peer(torchrun) {peer_s:.2f} s "
          f"({len(peer)}/{runs} recovered), ratio {ours_s / peer_s:.2f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer-python", default="", help="accepted for the Makefile; not used (see the docstring)")
    parser.add_argument("--runs", type=int, default=5, help="overhead runs of each kind")
    parser.add_argument("--restart-runs", type=int, default=3)
    parser.add_argument("--only", choices=("overhead", "restart"), default=None)
    args = parser.parse_args()
    if args.only in (None, "overhead"):
        overhead(0.05, 150, args.runs)
        overhead(0.005, 600, args.runs)
    if args.only in (None, "restart"):
        restart(args.restart_runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
