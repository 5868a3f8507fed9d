"""`nvrx demo`: survive a crash and a hang, then prove nothing was lost.

Runs the deterministic demo job (nvrx_core.demo.train) on N gloo ranks under ft_launcher,
with a rank killed in the first cycle and a rank hung in the second, streams the
interesting lines live, prints an incident summary built from the event log, then runs
the same job without faults and compares the final weights hashes.
"""

import os
import re
import subprocess
import sys
import tempfile
import time

from nvrx_core.exit_codes import describe
from nvrx_core.report.build import build_report
from nvrx_core.report.text import describe_incident

# Lines worth showing live; the full output goes to launcher.log.
_SHOW = re.compile(r"step +\d+/|simulated fault|hung:|Current thread|File \".*train.py\"|failed \(exitcode|"
                   r"final weights hash|giving up|error", re.IGNORECASE)


def _launch(workdir: str, name: str, nproc: int, steps: int, faults, live: bool) -> int:
    run_dir = os.path.join(workdir, name)
    os.makedirs(run_dir, exist_ok=True)
    cmd = [
        sys.executable, "-m", "nvrx_core.ft.command", "--nproc-per-node", str(nproc), "--max-restarts", "3",
        "--events-file", os.path.join(run_dir, "events.jsonl"),
        "--ft-initial-rank-heartbeat-timeout", "60", "--ft-rank-heartbeat-timeout", "3",
        "-m", "nvrx_core.demo.train", "--steps", str(steps), "--ckpt-dir", os.path.join(run_dir, "ckpt"),
        "--hash-file", os.path.join(run_dir, "weights.sha"), "--progress",
    ]
    for fault in faults:
        cmd += ["--fault", fault]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("FAULT_TOL_FINISHED_FLAG_FILE", None)
    with open(os.path.join(run_dir, "launcher.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log.write(line)
            if live and _SHOW.search(line) and ("step" not in line or "/" not in line or _every_fifth(line)):
                print("  | " + line.rstrip()[:160], flush=True)
        return proc.wait()


def _every_fifth(line: str) -> bool:
    m = re.search(r"step +(\d+)/", line)
    return m is None or int(m.group(1)) % 5 == 0


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return "<missing>"


def run_demo(nproc: int = 4, steps: int = 60, workdir: str = None) -> int:
    workdir = workdir or tempfile.mkdtemp(prefix="nvrx-demo-")
    crash_step, hang_step = steps // 4 + 2, steps // 2 + 3
    faults = [f"rank_killed:{min(2, nproc - 1)}:{crash_step}:0", f"rank_hung:{min(1, nproc - 1)}:{hang_step}:1"]
    print(f"nvrx demo: {nproc} ranks (gloo, CPU), {steps} steps, checkpoint every 10 steps; files in {workdir}")
    print(f"  injected: rank {min(2, nproc - 1)} killed at step {crash_step} (cycle 0), "
          f"rank {min(1, nproc - 1)} hangs at step {hang_step} (cycle 1); heartbeat timeout 3 s")
    t0 = time.monotonic()
    code = _launch(workdir, "faulty", nproc, steps, faults, live=True)
    print(f"ft_launcher exited {code} ({describe(code)}) after {time.monotonic() - t0:.1f} s")
    print("\nIncident summary:")
    incidents = build_report(os.path.join(workdir, "faulty", "events.jsonl")).incidents
    for incident in incidents:
        print("\n".join("  " + line for line in describe_incident(incident)))
    print("\nFault-free reference run (same seed, same data order) ...")
    ref_code = _launch(workdir, "reference", nproc, steps, [], live=False)
    faulty_hash = _read(os.path.join(workdir, "faulty", "weights.sha"))
    ref_hash = _read(os.path.join(workdir, "reference", "weights.sha"))
    same = code == 0 and ref_code == 0 and faulty_hash == ref_hash and faulty_hash != "<missing>"
    print(f"  weights hash with faults:    {faulty_hash}")
    print(f"  weights hash without faults: {ref_hash}")
    print("  => IDENTICAL: nothing was lost" if same else "  => MISMATCH: recovery lost or changed work")
    return 0 if same and len(incidents) == 2 else 1
