"""Goodput soak of respawn-rank against restart-all: random SIGKILLs for N minutes, each policy.

examples/respawn_ddp.py (4 gloo ranks, DDP, --step-time s steps, a checkpoint every 20 steps)
runs under ft_launcher with --ft-restart-policy respawn-rank, then under the default policy
(every rank restarts from the checkpoint), each sized to fill --minutes. Kills arrive at
exponential intervals of mean --mtbf seconds (seeded, the same schedule for both): a random
rank's current process is SIGKILLed. A fault-free run gives the weights both must end with.

ETTR (ground truth, this harness's clock) = steps x the fault-free median step time / the
launcher's wall time.

    python bench/soak_respawn.py --minutes 10 --mtbf 30

Prints `soak_respawn_ettr: ours X%, peer(restart-all) Y%, ratio Z` and whether the weights
equal the fault-free run's.
"""

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from respawn import JOB, REPO, weights

RANKS = 4


def launch(workdir: str, steps: int, step_time: float, respawn: bool) -> subprocess.Popen:
    os.makedirs(workdir, exist_ok=True)
    cmd = [sys.executable, "-m", "nvrx_core.ft.command", "--nproc-per-node", str(RANKS), "--max-restarts", "1000",
           "--monitor-interval", "0.1", "--max-no-progress-restarts", "0",
           "--events-file", os.path.join(workdir, "events.jsonl"),
           *(["--ft-restart-policy", "respawn-rank", "--max-respawns", "1000"] if respawn else []),
           JOB, "--workdir", workdir, "--steps", str(steps), "--step-time", str(step_time)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=REPO)
    env.pop("NVRX_EVENTS_FILE", None)
    log = open(os.path.join(workdir, "launcher.log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def current_pid(workdir: str, rank: int):
    try:
        with open(os.path.join(workdir, f"steps.rank{rank}")) as f:
            lines = f.read().splitlines()
        return int(lines[-1].split()[2]) if lines else None
    except (FileNotFoundError, IndexError, ValueError):
        return None


def soak(workdir: str, steps: int, args, respawn: bool) -> dict:
    rng = random.Random(args.seed)
    started = time.time()
    proc = launch(workdir, steps, args.step_time, respawn)
    kills = 0
    next_fault = started + rng.expovariate(1.0 / args.mtbf)
    while proc.poll() is None:
        now = time.time()
        if now >= next_fault and now < started + args.minutes * 60:
            pid = current_pid(workdir, rng.randrange(RANKS))
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                    kills += 1
                except ProcessLookupError:
                    pass
            next_fault = now + rng.expovariate(1.0 / args.mtbf)
        time.sleep(0.05)
    return {"code": proc.returncode, "wall": time.time() - started, "kills": kills, "weights": weights(workdir)}


def median_step(workdir: str) -> float:
    with open(os.path.join(workdir, "steps.rank0")) as f:
        times = [float(line.split()[1]) for line in f]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between kills")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    root = args.workdir or tempfile.mkdtemp(prefix="nvrx-soak-respawn-")
    steps = int(args.minutes * 60 * 0.9 / args.step_time)
    print(f"soak: {args.minutes} min per policy, MTBF {args.mtbf} s, {steps} steps of {args.step_time} s; "
          f"files in {root}", flush=True)
    reference = os.path.join(root, "reference")
    launch(reference, steps, 0.0, respawn=False).wait()
    probe = os.path.join(root, "probe")
    launch(probe, 200, args.step_time, respawn=False).wait()
    step_s = median_step(probe)
    expected = weights(reference)
    ettr = {}
    for name, respawn in (("respawn", True), ("restart-all", False)):
        result = soak(os.path.join(root, name), steps, args, respawn)
        ettr[name] = steps * step_s / result["wall"]
        print(f"{name}: exit {result['code']}, {result['kills']} kills, wall {result['wall']:.1f} s, "
              f"ETTR {100 * ettr[name]:.1f}%, weights equal the fault-free run's: {result['weights'] == expected}",
              flush=True)
    print(f"soak_respawn_ettr: ours {100 * ettr['respawn']:.1f}%, peer(restart-all) {100 * ettr['restart-all']:.1f}%, "
          f"ratio {ettr['respawn'] / ettr['restart-all']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
