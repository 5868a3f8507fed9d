"""Cost of the FT client's hot-path calls: one heartbeat, one section open+close.

Each client runs inside its own launcher (ours; nvidia-resiliency-ext 0.4.1's ft_launcher
from the venv given by --peer-python), talking to that launcher's real monitor. Medians of
--runs launcher runs, each itself a median over batches of calls: paced (a call per step,
the realistic case) and in bursts faster than any monitor reads (bench/_overhead_job.py).

    python bench/overhead.py --peer-python .venv-peer/bin/python
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from _baseline import Baseline, run_with_baseline

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_overhead_job.py")
FLAGS = ["--nproc-per-node", "1", "--ft-rank-section-timeouts", "step:600", "--ft-rank-heartbeat-timeout", "600",
         "--ft-initial-rank-heartbeat-timeout", "600"]


def measure(launcher: list, client: str, baseline: Baseline = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [*launcher, *FLAGS, JOB, "--client", client, "--batches", "15", "--batch", "1000"]
    cwd = None
    if baseline is not None:  # this job file, that tree's code (`-m` resolves in the cwd first)
        env, cwd = baseline.env(env), baseline.tree
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=cwd)
    for line in out.stdout.splitlines():
        if "RESULT {" in line:  # the peer's launcher may prefix or suffix worker lines
            return json.JSONDecoder().raw_decode(line[line.index("RESULT {") + len("RESULT "):])[0]
    raise RuntimeError(f"{client} run printed no result (exit {out.returncode}):\n{out.stdout[-2000:]}"
                       f"\n{out.stderr[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-python", default=None)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--baseline", metavar="REV", help="also measure ours at this git revision, as a peer")
    args = parser.parse_args()
    return run_with_baseline(args.baseline, lambda baseline: run(args, baseline))


def run(args, baseline) -> int:
    ours_cmd = [sys.executable, "-m", "nvrx_core.ft.command"]
    peer_launcher = os.path.join(os.path.dirname(args.peer_python), "ft_launcher") if args.peer_python else None
    runs = {"ours": [], "peer": [], "baseline": []}
    for _ in range(args.runs):  # interleaved, so machine load hits both alike
        runs["ours"].append(measure(ours_cmd, "ours"))
        if peer_launcher and os.path.exists(peer_launcher):
            runs["peer"].append(measure([peer_launcher], "nvrx"))
        if baseline is not None:
            runs["baseline"].append(measure(ours_cmd, "ours", baseline))
    for key, label in (("heartbeat_us", "heartbeat"), ("section_us", "section_open_close"),
                       ("heartbeat_burst_us", "heartbeat_burst"), ("section_burst_us", "section_open_close_burst")):
        ours = statistics.median(r[key] for r in runs["ours"])
        if runs["peer"]:
            peer = statistics.median(r[key] for r in runs["peer"])
            print(f"{label}: ours {ours:.2f} us, peer(nvrx-0.4.1) {peer:.2f} us, ratio {ours / peer:.3f}")
        else:
            print(f"{label}: ours {ours:.2f} us, peer(nvrx-0.4.1) not run (no --peer-python)")
        if runs["baseline"]:
            before = statistics.median(r[key] for r in runs["baseline"])
            print(f"{label}: ours {ours:.2f} us, peer({baseline.label}) {before:.2f} us, ratio {ours / before:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
