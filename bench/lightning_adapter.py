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
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from _process import run_group

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_lightning_job.py")
FT_FLAGS = ["--ft-initial-rank-heartbeat-timeout", "120", "--ft-rank-heartbeat-timeout", "30"]
PRELOAD = ["--warm-start-preload", "lightning.pytorch,nvrx_lightning"]
WARMUP_STEPS = 10


def launcher(name: str, peer_python: str) -> list:
    common = ["--nproc-per-node", "2", "--max-restarts", "2"]
    if name == "ours":
        return [sys.executable, "-m", "nvrx_core.ft.command", *common, *FT_FLAGS, *PRELOAD, JOB]
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *common, JOB]
    return [os.path.join(os.path.dirname(peer_python), "ft_launcher"), *common, *FT_FLAGS, JOB]


def run_job(name: str, peer_python: str, job_args: list, limit: float) -> tuple:
    workdir = tempfile.mkdtemp(prefix=f"nvrx-bench-lightning-{name}-")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("NVRX_EVENTS_FILE", None)
    with open(os.path.join(workdir, "launcher.log"), "w") as log:
        code = run_group(launcher(name, peer_python) + [*job_args, "--workdir", workdir], log, env, limit)
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
            code, records = run_job("ours", "", job + ["--callbacks", callbacks], limit=300)
            if code == 0:
                measured[callbacks].append(step_interval(records))
    ours, plain = statistics.median(measured["ours"]), statistics.median(measured["none"])
    print(f"  step interval runs (ms): ours {[round(v * 1e3, 2) for v in measured['ours']]}, "
          f"none {[round(v * 1e3, 2) for v in measured['none']]}", flush=True)
    print(f"lightning_overhead_{step_s * 1e3:g}ms_step: ours {ours * 1e3:.2f} ms, peer(no callbacks) "
          f"{plain * 1e3:.2f} ms, ratio {ours / plain:.3f} (cost {100 * (ours / plain - 1):+.2f}%)", flush=True)


# ---- 2. restart ------------------------------------------------------------------------------

def recovery(records: list):
    fault = next((r["t"] for r in records if r["ev"] == "fault"), None)
    if fault is None:
        return None
    restarted = {r["pid"] for r in records if r["ev"] == "started" and r["t"] > fault}
    after = [r["t"] for r in records if r["ev"] == "step" and r["pid"] in restarted]
    return min(after) - fault if after else None


def peer_has_callback(peer_python: str) -> str:
    """'' if nvidia-resiliency-ext's Lightning callback imports in the peer venv, else why not."""
    if not peer_python or not os.path.exists(peer_python):
        return "no nvidia-resiliency-ext venv given (--peer-python; `make peer` builds .venv-peer)"
    probe = subprocess.run([peer_python, "-c", "from nvidia_resiliency_ext.ptl_resiliency import FaultToleranceCallback"],
                           capture_output=True, text=True)
    return "" if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["import failed"])[-1]


def restart(peer_python: str, runs: int) -> None:
    job = ["--fault", "kill", "--fault-step", "15", "--steps", "30", "--checkpoint-every", "10",
           "--step-time", "0.05", "--record-each-step"]
    names = {"ours": "ours", "torchrun": "none"}
    why_not = peer_has_callback(peer_python)
    if why_not:
        print(f"  nvidia-resiliency-ext 0.4.1 not measured: {why_not}", flush=True)
    else:
        names["nvrx-0.4.1"] = "peer"
    measured = {name: [] for name in names}
    for _ in range(runs):
        for name, callbacks in names.items():
            kind = "nvrx" if name == "nvrx-0.4.1" else name
            _, records = run_job(kind, peer_python, job + ["--callbacks", callbacks], limit=300)
            measured[name].append(recovery(records))
    for name, values in measured.items():
        print(f"  {name:10s} kill -> first step after restart (s): "
              f"{[round(v, 2) if v is not None else None for v in values]}", flush=True)
    ours = statistics.median([v for v in measured["ours"] if v is not None] or [float("nan")])
    for name in names:
        if name == "ours":
            continue
        done = [v for v in measured[name] if v is not None]
        peer = statistics.median(done) if done else float("nan")
        print(f"lightning_restart_kill: ours {ours:.2f} s, peer({name}) {peer:.2f} s, ratio {ours / peer:.2f}",
              flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer-python", default="", help="python of the venv with nvidia-resiliency-ext 0.4.1")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", choices=("overhead", "restart"), default=None)
    args = parser.parse_args()
    if args.only in (None, "overhead"):
        overhead(0.05, 150, args.runs)
        overhead(0.005, 600, args.runs)
    if args.only in (None, "restart"):
        restart(args.peer_python, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
