"""Goodput soak: random faults into a training job under ft_launcher for N minutes.

The demo job (2 gloo ranks, --step-time s padded steps, checkpoint every --ckpt-every steps,
deterministic data) runs long enough for --minutes. Faults arrive at exponential intervals of
mean --mtbf seconds (seeded): a random rank is killed, raises, or hangs (asked through the job's
--fault-file). Then fault-free runs give the reference: the weights of the same steps (run
without the step padding, which only sleeps: same data, same weights, seconds instead of
minutes) and the undisturbed step time (PROBE_STEPS padded steps).

Ground truth, measured here and not from the events: ETTR = steps x the fault-free median
step time / the faulty launcher's wall time (this harness's clock, process start to exit).
`nvrx report` computes its ETTR from the events file alone; the two are printed side by side.

    python bench/soak.py --minutes 10 --mtbf 30 --kinds kill,exception [--png docs/report_soak.png]
    python bench/soak.py --minutes 10 --mtbf 30 --kinds kill,exception,hang --hang-timeout 5
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from nvrx_core.events import read_events
from nvrx_core.report.build import build_report

KINDS = {"kill": "rank_killed", "exception": "rank_exception", "hang": "rank_hung"}
STARTUP_ALLOWANCE = 0.9
"""Share of the wall time the job's steps are sized to fill (the rest: startup, recoveries)."""
PROBE_STEPS = 200


def launch(workdir: str, steps: int, args, fault_file: str = None, step_time: float = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nvrx_core.ft.command", "--nproc-per-node", "2", "--max-restarts", "1000",
           "--events-file", os.path.join(workdir, "events.jsonl"),
           "--ft-initial-rank-heartbeat-timeout", "120", "--ft-rank-heartbeat-timeout", str(args.hang_timeout),
           "-m", "nvrx_core.demo.train", "--steps", str(steps),
           "--step-time", str(args.step_time if step_time is None else step_time),
           "--ckpt-every", str(args.ckpt_every), "--ckpt-dir", os.path.join(workdir, "ckpt"),
           "--hash-file", os.path.join(workdir, "weights.sha")]
    if fault_file:
        cmd += ["--fault-file", fault_file]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("NVRX_EVENTS_FILE", None)
    log = open(os.path.join(workdir, "launcher.log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def soak(workdir: str, steps: int, args) -> dict:
    rng = random.Random(args.seed)
    kinds = [KINDS[k] for k in args.kinds.split(",")]
    fault_file = os.path.join(workdir, "fault-request.json")
    started = time.time()
    proc = launch(workdir, steps, args, fault_file)
    requested = []
    next_fault = started + rng.expovariate(1.0 / args.mtbf)
    while proc.poll() is None:
        now = time.time()
        if now >= next_fault and now < started + args.minutes * 60:
            request = {"id": len(requested), "rank": rng.randrange(2), "kind": rng.choice(kinds)}
            tmp = fault_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(request, f)
            os.replace(tmp, fault_file)
            requested.append(request)
            next_fault = now + rng.expovariate(1.0 / args.mtbf)
        time.sleep(0.05)
    wall = time.time() - started
    return {"code": proc.returncode, "wall": wall, "requested": requested}


def median_step(events) -> float:
    done = sorted((e["time"], e["step"]) for e in events if e["kind"] == "step_done")
    return statistics.median(b[0] - a[0] for a, b in zip(done, done[1:]) if b[1] == a[1] + 1)


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return "<missing>"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between faults")
    p.add_argument("--kinds", default="kill,exception", help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--hang-timeout", type=float, default=5.0, help="heartbeat timeout (s)")
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", default=None)
    p.add_argument("--png", default=None, help="draw the faulty run's report picture here")
    p.add_argument("--peer-python", default=None, help="(ignored: no peer offers a goodput report)")
    args = p.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="nvrx-soak-")
    steps = int(args.minutes * 60 * STARTUP_ALLOWANCE / args.step_time)
    faulty, reference, probe = (os.path.join(workdir, name) for name in ("faulty", "reference", "probe"))
    for path in (faulty, reference, probe):
        os.makedirs(path, exist_ok=True)
    print(f"soak: {args.minutes} min, MTBF {args.mtbf} s, faults {args.kinds}, {steps} steps of {args.step_time} s, "
          f"checkpoint every {args.ckpt_every}; files in {workdir}", flush=True)
    result = soak(faulty, steps, args)
    ref = launch(reference, steps, args, step_time=0.0)
    ref.wait()
    launch(probe, PROBE_STEPS, args).wait()
    step_s = median_step(read_events(os.path.join(probe, "events.jsonl")))
    truth = steps * step_s / result["wall"]
    report = build_report(os.path.join(faulty, "events.jsonl"))
    ettr = report.goodput.ettr if report.goodput else None
    same = read(os.path.join(faulty, "weights.sha")) == read(os.path.join(reference, "weights.sha")) != "<missing>"
    print(report.text())
    verdicts = {}
    for incident in report.incidents:
        verdicts[incident.verdict.kind] = verdicts.get(incident.verdict.kind, 0) + 1
    print(f"faults requested: {len(result['requested'])}; incidents reported: {len(report.incidents)} {verdicts}")
    print(f"launcher exit {result['code']}, reference exit {ref.returncode}; weights equal: {same}")
    ettr_text = f"{100 * ettr:.1f}%" if ettr is not None else "?"
    print(f"soak_ettr: report {ettr_text}, ground truth {100 * truth:.1f}% "
          f"({steps} steps x {step_s:.4f} s / {result['wall']:.1f} s wall)")
    if args.png:
        from nvrx_core.report.plot import write_png

        write_png(report, args.png)
        print(f"picture: {args.png}")
    return 0 if result["code"] == 0 and same else 1


if __name__ == "__main__":
    sys.exit(main())
