"""What the adapter benches (lightning_adapter.py, hf.py) share: running a 2-rank job under a
launcher with its timeline, the per-step cost with and without callbacks, and the seconds from a
killed rank to the first step of a restarted one. Their jobs write the timeline
(bench/_job_parts.recorder): "steps" (every step's end time), "fault", "started", "step"."""

import json
import os
import shutil
import statistics
import tempfile
from typing import Callable, Dict, List, Optional, Tuple

from _process import run_group

WARMUP_STEPS = 10

Run = Callable[[str, List[str]], Tuple[int, List[dict]]]
"""(launcher name, job arguments) -> (exit code, timeline records)."""


def run_job(label: str, command: List[str], job_args: List[str], limit: float,
            env: Optional[Dict[str, str]] = None) -> Tuple[int, List[dict]]:
    """Run `command job_args --workdir DIR` in a process group of its own (killed after `limit`
    seconds); the timeline it left. A failed run's directory is kept and named."""
    workdir = tempfile.mkdtemp(prefix=f"nvrx-bench-{label}-")
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    full_env.pop("NVRX_EVENTS_FILE", None)
    with open(os.path.join(workdir, "launcher.log"), "w") as log:
        code = run_group(command + [*job_args, "--workdir", workdir], log, full_env, limit)
    records = []
    try:
        with open(os.path.join(workdir, "timeline.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        pass
    if code != 0:
        print(f"  {label} {' '.join(job_args)}: exit {code}; log kept in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return code, records


def step_interval(records: List[dict]) -> float:
    """Median interval between step ends after the warm-up steps, over every rank."""
    intervals = []
    for rec in records:
        if rec["ev"] == "steps":
            ends = rec["ends"][WARMUP_STEPS:]
            intervals += [b - a for a, b in zip(ends, ends[1:])]
    return statistics.median(intervals) if intervals else float("nan")


def hook_time_per_step(records: List[dict], steps: int) -> Optional[float]:
    """Mean seconds per step the timed callback spent in its hooks, over the ranks (None: the
    job did not time its callback)."""
    spent = [r["hook_seconds"] for r in records if r["ev"] == "steps" and r.get("hook_seconds") is not None]
    return statistics.mean(spent) / steps if spent else None


def overhead(run: Run, figure: str, step_s: float, steps: int, runs: int) -> None:
    """`runs` interleaved pairs under our launcher, the job's callbacks off ("none") and on
    ("ours"); prints the median step interval of each and their ratio, the median of the
    pairs' ratios (each pair ran back to back, so a drift of the machine's load cancels), and,
    where the job times its callback's hooks, their own time per step."""
    job = ["--step-time", str(step_s), "--steps", str(steps)]
    measured: Dict[str, List[float]] = {"ours": [], "none": []}
    pairs: List[float] = []
    hooks: List[float] = []
    for _ in range(runs):
        pair = {}
        for callbacks in ("none", "ours"):
            code, records = run("ours", job + ["--callbacks", callbacks])
            if code == 0:
                pair[callbacks] = step_interval(records)
                measured[callbacks].append(pair[callbacks])
                hook = hook_time_per_step(records, steps)
                if hook is not None:
                    hooks.append(hook)
        if len(pair) == 2:
            pairs.append(pair["ours"] / pair["none"])
    ours = statistics.median(measured["ours"] or [float("nan")])
    plain = statistics.median(measured["none"] or [float("nan")])
    print(f"  step interval runs (ms): ours {[round(v * 1e3, 2) for v in measured['ours']]}, "
          f"none {[round(v * 1e3, 2) for v in measured['none']]}", flush=True)
    print(f"{figure}_{step_s * 1e3:g}ms_step: ours {ours * 1e3:.2f} ms, peer(no callbacks) {plain * 1e3:.2f} ms, "
          f"ratio {ours / plain:.3f} (cost {100 * (ours / plain - 1):+.2f}%)", flush=True)
    if pairs:
        paired = statistics.median(pairs)
        print(f"{figure}_{step_s * 1e3:g}ms_step_paired: median of {len(pairs)} pair ratios {paired:.3f} "
              f"(cost {100 * (paired - 1):+.2f}%)", flush=True)
    if hooks:
        hook = statistics.median(hooks)
        print(f"{figure}_{step_s * 1e3:g}ms_step_hooks: ours {hook * 1e6:.1f} us per step in the callback's hooks, "
              f"{100 * hook / plain:.3f}% of the step without callbacks", flush=True)


KILL_JOB = ["--fault", "kill", "--fault-step", "15", "--steps", "30", "--checkpoint-every", "10",
            "--step-time", "0.05", "--record-each-step"]
"""Rank 1 SIGKILLed at step 15 of 30, a checkpoint every 10 steps."""


def kill_recoveries(run: Run, callbacks_of: Dict[str, str], runs: int) -> Dict[str, List[Optional[float]]]:
    """`runs` rounds of the kill job under each launcher (name -> its --callbacks), interleaved:
    name -> seconds from the kill to a restarted rank's first step (None: never recovered)."""
    measured: Dict[str, List[Optional[float]]] = {name: [] for name in callbacks_of}
    for _ in range(runs):
        for name, callbacks in callbacks_of.items():
            _, records = run(name, KILL_JOB + ["--callbacks", callbacks])
            measured[name].append(recovery(records))
    for name, values in measured.items():
        print(f"  {name:10s} kill -> first step after restart (s): "
              f"{[round(v, 2) if v is not None else None for v in values]}", flush=True)
    return measured


def recovery(records: List[dict]) -> Optional[float]:
    """Seconds from the kill to the first step a process started after it completed."""
    fault = next((r["t"] for r in records if r["ev"] == "fault"), None)
    if fault is None:
        return None
    restarted = {r["pid"] for r in records if r["ev"] == "started" and r["t"] > fault}
    after = [r["t"] for r in records if r["ev"] == "step" and r["pid"] in restarted]
    return min(after) - fault if after else None


def median_of_recovered(values: List[Optional[float]]) -> Tuple[float, int]:
    done = [v for v in values if v is not None]
    return (statistics.median(done) if done else float("nan")), len(done)
