"""nvrx_megatron's fault-tolerance hooks: their cost per iteration of a Bridge-style loop.

A 1-rank loop with 50 ms steps (bench/_megatron_job.py) under a real launcher and monitor:
ours (ft_launcher, nvrx_megatron.fault_tolerance's hooks), nvidia-resiliency-ext 0.4.1 (its
ft_launcher, its client making the same section calls; --peer-python), and the same loop
with no FT calls under ft_launcher. Medians of --runs runs, interleaved.

    python bench/megatron.py --peer-python .venv-peer/bin/python [--runs 5]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_megatron_job.py")
FLAGS = ["--nproc-per-node", "1", "--ft-rank-section-timeouts", "setup:600,step:600,checkpointing:600",
         "--ft-rank-out-of-section-timeout", "600"]


def measure(launcher: list, client: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([*launcher, *FLAGS, JOB, "--client", client], capture_output=True, text=True, env=env,
                         timeout=300)
    for line in out.stdout.splitlines():
        if "RESULT {" in line:
            return json.JSONDecoder().raw_decode(line[line.index("RESULT {") + len("RESULT "):])[0]
    raise RuntimeError(f"{client}: no result (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer-python", default="")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    ours_launcher = [sys.executable, "-m", "nvrx_core.ft.command"]
    peer_launcher = [os.path.join(os.path.dirname(args.peer_python), "ft_launcher")] if args.peer_python else None
    if peer_launcher and not os.path.exists(peer_launcher[0]):
        print(f"nvidia-resiliency-ext not measured: no {peer_launcher[0]} (make peer builds it)")
        peer_launcher = None
    runs = {"ours": [], "none": [], "nvrx": []}
    for _ in range(args.runs):
        runs["none"].append(measure(ours_launcher, "none"))
        runs["ours"].append(measure(ours_launcher, "ours"))
        if peer_launcher:
            runs["nvrx"].append(measure(peer_launcher, "nvrx"))
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("hooks_us", "iteration_ms")} for k, v in runs.items() if v}
    for name, value in med.items():
        print(f"  {name:5s} runs: hooks_us {[round(r['hooks_us'], 1) for r in runs[name]]}, "
              f"iteration_ms {[round(r['iteration_ms'], 3) for r in runs[name]]}")
    ours, none = med["ours"], med["none"]
    print(f"megatron_hooks_share_of_50ms_step: ours {ours['hooks_us']:.1f} us per iteration = "
          f"{100 * ours['hooks_us'] / 50e3:.3f}% (goal <= 1%)")
    print(f"megatron_iteration_time: ours {ours['iteration_ms']:.3f} ms, peer(no hooks) {none['iteration_ms']:.3f} ms, "
          f"ratio {ours['iteration_ms'] / none['iteration_ms']:.4f}")
    if "nvrx" in med:
        peer = med["nvrx"]
        print(f"megatron_hooks_per_iteration: ours {ours['hooks_us']:.1f} us, peer(nvrx-0.4.1 client, same section "
              f"calls) {peer['hooks_us']:.1f} us, ratio {ours['hooks_us'] / peer['hooks_us']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
