"""Respawn one rank vs restart all: SIGKILLed rank -> the next step every rank completes.

examples/respawn_ddp.py (4 gloo ranks, DDP, 50 ms steps, a checkpoint every 20 steps) runs
under each launcher and kills its rank 2 at step 30:
- ours, respawn: ft_launcher --ft-restart-policy respawn-rank (the other ranks keep running);
- ours, restart-all: ft_launcher as before (every rank restarts from the checkpoint);
- torchrun, and nvidia-resiliency-ext 0.4.1's ft_launcher (--peer-python, `make peer`).

    python bench/respawn.py [--runs 5] [--peer-python .venv-peer/bin/python]

For each run: recovery = the last rank's first step completed after the kill, minus the kill
time; redone = steps completed again that some rank had completed before the kill; whether
the ranks that were not killed kept their processes; whether the weights equal a fault-free
run's. Prints `respawn_recovery: ours X s, peer(<name>) Y s, ratio Z` lines (medians).
"""

import argparse
import glob
import os
import shutil
import statistics
import sys
import tempfile
from typing import Dict, List, Optional

from _process import run_group

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(REPO, "examples", "respawn_ddp.py")
KILLED_RANK, KILL_STEP, STEPS = 2, 30, 60


def command(name: str, peer_python: Optional[str]) -> List[str]:
    common = ["--nproc-per-node", "4", "--max-restarts", "3", "--monitor-interval", "0.1"]
    if name == "ours-respawn":
        return [sys.executable, "-m", "nvrx_core.ft.command", *common, "--ft-restart-policy", "respawn-rank", JOB]
    if name == "ours-restart-all":
        return [sys.executable, "-m", "nvrx_core.ft.command", *common, JOB]
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *common, JOB]
    return [os.path.join(os.path.dirname(peer_python), "ft_launcher"), *common, JOB]


def steps_of(workdir: str, rank: int) -> List[tuple]:
    with open(os.path.join(workdir, f"steps.rank{rank}")) as f:
        return [(int(s), float(t), int(p)) for s, t, p in (line.split() for line in f)]


def weights(workdir: str) -> set:
    found = set()
    for path in glob.glob(os.path.join(workdir, "weights.rank*")):
        with open(path) as f:
            found.add(f.read())
    return found


def run_once(name: str, peer_python: Optional[str], fault: bool) -> Dict:
    workdir = tempfile.mkdtemp(prefix=f"nvrx-bench-respawn-{name}-")
    args = ["--workdir", workdir, "--steps", str(STEPS)]
    if fault:
        args += ["--fault", f"kill:{KILLED_RANK}:{KILL_STEP}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=REPO)
    env.pop("NVRX_EVENTS_FILE", None)
    try:
        with open(os.path.join(workdir, "launcher.log"), "w") as log:
            code = run_group(command(name, peer_python) + args, log, env, limit=300)
        result = {"code": code, "weights": weights(workdir)}
        if fault:
            result.update(_recovery(workdir))
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _recovery(workdir: str) -> Dict:
    [killed_file] = glob.glob(os.path.join(workdir, "killed.*"))
    with open(killed_file) as f:
        killed_at = float(f.read())
    firsts, redone, kept = [], 0, True
    for rank in range(4):
        steps = steps_of(workdir, rank)
        before = [s for s, t, _ in steps if t <= killed_at]
        after = [(t, s, p) for s, t, p in steps if t > killed_at]
        if not after:
            return {"recovery": None, "redone": None, "kept": False}
        firsts.append(after[0][0])
        done = max(before, default=0)
        redone += sum(1 for _, s, _ in after if s <= done)
        if rank != KILLED_RANK:
            kept &= {p for _, _, p in steps} == {steps[0][2]}
    return {"recovery": max(firsts) - killed_at, "redone": redone, "kept": kept}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--peer-python", default=None, help="python of a venv with nvidia-resiliency-ext (make peer)")
    args = parser.parse_args()
    names = ["ours-respawn", "ours-restart-all", "torchrun"] + (["nvrx"] if args.peer_python else [])
    reference = run_once("ours-restart-all", None, fault=False)["weights"]
    print(f"fault-free weights: {sorted(w[:16] for w in reference)} (exit {0 if len(reference) == 1 else 'differ'})")
    medians = {}
    for name in names:
        runs = [run_once(name, args.peer_python, fault=True) for _ in range(args.runs)]
        times = [r["recovery"] for r in runs if r.get("recovery") is not None]
        medians[name] = statistics.median(times) if times else None
        print(f"{name}: recovery {[round(t, 3) for t in times]} s, steps redone {[r['redone'] for r in runs]}, "
              f"others kept their processes {[r['kept'] for r in runs]}, "
              f"weights equal {[r['weights'] == reference for r in runs]}, exits {[r['code'] for r in runs]}")
    ours = medians["ours-respawn"]
    for name in names[1:]:
        peer = medians[name]
        ratio = f"{peer / ours:.1f}" if ours and peer else "n/a"
        print(f"respawn_recovery: ours {ours and round(ours, 3)} s, peer({name}) {peer and round(peer, 3)} s, "
              f"ratio {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
