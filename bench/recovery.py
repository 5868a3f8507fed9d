"""Recovery time: fault -> first completed step after restart, ours vs torchrun vs nvidia-resiliency-ext.

The same toy job (bench/_toy_job.py: 2 gloo ranks, ~50 ms steps, checkpoint every 10 steps)
runs under each launcher; one rank is killed (or hangs) at step 15. Medians of --runs runs.

    python bench/recovery.py --peer-python .venv-peer/bin/python [--runs 3] [--reliability 20]

Prints `recovery_<fault>: ours X s, peer(<name>) Y s, ratio Z` lines; --reliability N also
runs N kill and N exception runs under ours and prints how many recovered and finished.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

from _baseline import Baseline, run_with_baseline
from _process import run_group

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_toy_job.py")
HEARTBEAT_TIMEOUT = 5.0
HANG_WAIT = 120.0  # how long a launcher gets to recover from a hang before we call it "never"


def launcher_command(name: str, peer_python: str):
    ft_flags = ["--ft-initial-rank-heartbeat-timeout", "60", "--ft-rank-heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
    common = ["--nproc-per-node", "2", "--max-restarts", "3"]
    if name == "ours":
        return [sys.executable, "-m", "nvrx_core.ft.command", *common, *ft_flags, JOB, "--client", "ours"]
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *common, JOB, "--client", "none"]
    ft_launcher = os.path.join(os.path.dirname(peer_python), "ft_launcher")
    return [ft_launcher, *common, *ft_flags, JOB, "--client", "nvrx"]


def run_once(name: str, fault: str, peer_python: str, limit: float, baseline: Baseline = None) -> dict:
    workdir = tempfile.mkdtemp(prefix=f"nvrx-bench-{name}-")
    cmd = launcher_command("ours" if baseline else name, peer_python) + ["--fault", fault, "--workdir", workdir]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("NVRX_EVENTS_FILE", None)
    if baseline is not None:
        cmd, env = baseline.command(cmd), baseline.env(env)
    with open(os.path.join(workdir, "launcher.log"), "w") as log:  # `-m` resolves in the cwd first
        code = run_group(cmd, log, env, limit, cwd=baseline.tree if baseline else None)
    records = []
    try:
        with open(os.path.join(workdir, "timeline.jsonl")) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass  # no worker got as far as its first record
    t_fault = next((r["t"] for r in records if r["ev"] == "fault"), None)
    # Steps of processes started after the fault: the healthy rank may log its last step late.
    new_pids = {r["pid"] for r in records if r["ev"] == "started" and t_fault is not None and r["t"] > t_fault}
    after = [r["t"] for r in records if r["ev"] == "step" and r["pid"] in new_pids]
    finished = code == 0 and sum(1 for r in records if r["ev"] == "done") == 2
    if finished or name != "ours":
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"  ours {fault}: run did not finish (exit {code}); kept {workdir}", flush=True)
    return {"recovery": (min(after) - t_fault) if after else None, "finished": finished, "exit": code}


def median_recovery(name, fault, peer_python, runs, limit, baseline=None):
    results = [run_once(name, fault, peer_python, limit, baseline) for _ in range(runs)]
    times = [r["recovery"] for r in results if r["recovery"] is not None]
    detail = ", ".join(f"{r['recovery']:.2f}" if r["recovery"] is not None else "never" for r in results)
    print(f"  {name:9s} {fault:5s} runs: [{detail}] exit codes {[r['exit'] for r in results]}", flush=True)
    if len(times) < len(results):
        return None
    return statistics.median(times)


def fmt(value, limit):
    return f"{value:.2f} s" if value is not None else f"no recovery within {limit:.0f} s"


def compare(fault, ours, peers, limit):
    for peer_name, peer in peers.items():
        ratio = f"{ours / peer:.2f}" if ours is not None and peer is not None else "n/a"
        print(f"recovery_{fault}: ours {fmt(ours, limit)}, peer({peer_name}) {fmt(peer, limit)}, ratio {ratio}",
              flush=True)


def reliability(n: int, peer_python: str, names) -> None:
    for name in names:
        for fault in ("kill", "exception"):
            ok = sum(run_once(name, fault, peer_python, 90)["finished"] for _ in range(n))
            label = "ours" if name == "ours" else f"peer({name})"
            print(f"reliability_{fault}: {label} {ok}/{n} runs recovered and finished", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-python", default=None, help="python of the venv with nvidia-resiliency-ext 0.4.1")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reliability", type=int, default=0, help="N kill + N exception runs under ours")
    parser.add_argument("--reliability-peers", action="store_true", help="also count torchrun's reliability")
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--baseline", metavar="REV", help="also measure ours at this git revision, as a peer")
    args = parser.parse_args()
    return run_with_baseline(args.baseline, lambda baseline: run(args, baseline))


def run(args, baseline) -> int:
    has_peer = bool(args.peer_python) and os.path.exists(os.path.join(os.path.dirname(args.peer_python),
                                                                      "ft_launcher"))
    if not has_peer:
        print("nvidia-resiliency-ext venv not given (--peer-python): comparing with torchrun only")
    if not args.skip_recovery:
        for fault, limit in (("kill", 90.0), ("hang", HANG_WAIT)):
            ours = median_recovery("ours", fault, args.peer_python, args.runs, limit)
            peers = {"torchrun": median_recovery("torchrun", fault, args.peer_python,
                                                 args.runs if fault == "kill" else 1, limit)}
            if has_peer:
                peers["nvrx-0.4.1"] = median_recovery("nvrx", fault, args.peer_python, args.runs, limit)
            if baseline is not None:
                peers[baseline.label] = median_recovery(baseline.label, fault, args.peer_python, args.runs, limit,
                                                        baseline)
            compare(fault, ours, peers, limit)
        print(f"(hang: heartbeat timeout {HEARTBEAT_TIMEOUT:.0f} s; acceptance: ours <= timeout + 3 s)")
    if args.reliability:
        reliability(args.reliability, args.peer_python, ["ours", "torchrun"] if args.reliability_peers else ["ours"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
