"""Slurm: a killed rank, a lost node and a preemption, under ours vs torchrun vs nvidia-resiliency-ext.

The same job (bench/_slurm_job.py: 2 nodes x 2 gloo ranks, ~75 ms steps, checkpoint every 10
steps) is submitted to the local cluster of tools/local_slurm.sh through NeMo-Run's
SlurmExecutor, as a user submits it, under three launchers:
- ours: FaultTolerancePlugin + PreemptionPlugin, our ft_launcher first on the job's PATH;
- torchrun: NeMo-Run's torchrun launcher, the same in-job restarts (3, as PET_MAX_RESTARTS: its
  torchrun command has no --max-restarts) and job retries (2);
- nvrx-0.4.1: the same two plugins with the peer venv's bin first on the job's PATH, so the
  `ft_launcher` and `python` NeMo-Run's script runs are nvidia-resiliency-ext 0.4.1's.

    python bench/slurm.py --peer-python .venv-peer/bin/python [--runs 3] [--quick]

Each case, medians of --runs jobs (fault -> the first step completed by a process started
after it, from the job's timeline of time.time() records):
- kill: rank 1 SIGKILLs itself at step 15 (once per job);
- node_lost: the allocation's second node crashes (tests/slurm_cluster.crash_node) after step
  15; with no spare every launcher needs a Slurm requeue;
- preemption: `scancel --signal=TERM` (every process of the job's steps, as --signal=TERM@N
  delivers it) after step 15; also whether the attempt counted as failed (NeMo-Run's
  <job>_job_results file, S or F per attempt; torchrun's template writes none).
ETTR over all attempts of each job: productive step time (steps x the job's median step) /
job wall time (sacct: first attempt's start to the last one's end); for ours also `nvrx report`'s
ETTR from the one events file every attempt appends to (NVRX_EVENTS_FILE).

Slurm holds a requeued job ~2 minutes (Reason=BeginTime) before it may start again; the bench
releases each hold 2 s after the requeue (`scontrol update StartTime=now`, as
tests/slurm_cluster.py does; see `follow` for the 2 s) and prints the hold Slurm had set: on a
real cluster it adds to node_lost and preemption.
Each job holds the cluster lock (/var/tmp/nvrx-slurm/tests.lock) the Slurm tests take.
Prints `slurm_<measure>: ours X, peer(<name>) Y, ratio Z` lines (ratio = ours / peer).
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
JOB = os.path.join(HERE, "_slurm_job.py")
from slurm_cluster import (FINAL_STATES, _environ, _pids, cluster_env, crash_node, exclusive,  # noqa: E402
                           nodes_back, slurm)
from nvrx_core.ft.config_env import FT_CONFIG_ENV  # noqa: E402
STEPS, FAULT_STEP = 60, 15
FT = dict(initial_rank_heartbeat_timeout=120, rank_heartbeat_timeout=10)  # as tests/test_slurm_nemo_run.py
RESTARTS, RETRIES = 3, 2
JOB_TIMEOUT, STALL = 300.0, 120.0  # seconds: a job's limit; running without a timeline record
RELEASE_AFTER = 2.0  # seconds after a requeue before the bench releases its hold (see follow)
CASES = ("kill", "node_lost", "preemption")
LABEL = {"ours": "ours", "torchrun": "peer(torchrun)", "nvrx": "peer(nvrx-0.4.1)"}


def launcher_setup(name, root, peer_bin):
    """(plugins, env, executor tweaks) that make NeMo-Run run this launcher."""
    bin_dir = peer_bin if name == "nvrx" else os.path.dirname(sys.executable)
    env = {"PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
    if name == "torchrun":
        env["PET_MAX_RESTARTS"] = str(RESTARTS)  # torchrun reads any flag from PET_<FLAG>
        return [], env, {"launcher": "torchrun", "retries": RETRIES}
    from nvrx_nemo_run import FaultTolerancePlugin, PreemptionPlugin

    if name == "ours":
        env["NVRX_EVENTS_FILE"] = os.path.join(root, "events.jsonl")
    plugins = [FaultTolerancePlugin(num_in_job_restarts=RESTARTS, num_job_retries_on_failure=RETRIES, **FT),
               PreemptionPlugin()]
    return plugins, env, {}


def submit(name, case, root, peer_bin):
    """Submit one job (detached); its Slurm id and NeMo-Run job directory."""
    import nemo_run as run

    plugins, env, tweaks = launcher_setup(name, root, peer_bin)
    args = ["--client", "none" if name == "torchrun" else name, "--workdir", root, "--steps", str(STEPS),
            "--fault-step", str(FAULT_STEP), "--fault", "kill" if case == "kill" else "none"]
    task = run.Script(path=JOB, entrypoint="python", args=args)
    executor = run.SlurmExecutor(account="nvrx", partition="debug", nodes=2, ntasks_per_node=2, time="00:15:00",
                                 tunnel=run.LocalTunnel(job_dir=os.path.join(root, "exp", "experiments")),
                                 env_vars=env, packager=run.Packager())
    for key, value in tweaks.items():
        setattr(executor, key, value)
    with open(os.path.join(root, "stdin"), "w+") as stdin, open(os.path.join(root, "submit.log"), "w") as log:
        saved, sys.stdin = sys.stdin, stdin  # NeMo-Run packages through invoke, which mirrors stdin
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                with run.Experiment("nvrx-bench", executor=executor, base_dir=os.path.join(root, "exp"),
                                    log_level="WARN", clean_mode=True, enable_goodbye_message=False) as exp:
                    exp.add(task, name="job", plugins=plugins)
                    exp.run(detach=True)
        finally:
            sys.stdin = saved
    job = exp.jobs[0]
    return job.handle.rsplit("/", 1)[-1], job.executor.job_dir


def show(job_id):
    return dict(re.findall(r"(\w+)=(\S*)", slurm("scontrol", "show", "job", "-o", job_id, check=False)))


def epoch(stamp):
    """Slurm's local time stamp in seconds; None for Unknown / None (an attempt not started)."""
    try:
        return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
    except (TypeError, ValueError):
        return None


def follow(job_id, root, on_running):
    """Poll until the job ended for good; release each requeue hold, noting how long Slurm set
    it for (StartTime - SubmitTime, which a requeue resets). (state, holds). A job that runs
    but writes no timeline record for STALL seconds is given up on (a launcher without hang
    detection can sit there until the time limit).

    Not in the requeue's own second: slurmd compares a job credential's creation with the
    revocation of the requeued attempt's in whole seconds, and a start within that second is
    refused ("Job credential revoked", the job then ends FAILED)."""
    deadline, released, holds = time.monotonic() + JOB_TIMEOUT, 0, []
    timeline, seen, alive = os.path.join(root, "timeline.jsonl"), None, time.monotonic()
    while True:
        fields = show(job_id)
        state, restarts = fields.get("JobState", ""), int(fields.get("Restarts", 0))
        if state in FINAL_STATES:
            return state, holds
        now_seen = (state, restarts, os.path.getsize(timeline) if os.path.exists(timeline) else 0)
        if now_seen != seen:
            seen, alive = now_seen, time.monotonic()
        if state == "RUNNING" and time.monotonic() - alive > STALL:
            return f"NO RECORD IN {STALL:.0f} s(bench)", holds  # run_job cancels it
        if (state == "PENDING" and fields.get("Reason") == "BeginTime" and restarts > released
                and time.time() >= (epoch(fields.get("SubmitTime")) or 0) + RELEASE_AFTER):
            begin, submitted = epoch(fields.get("StartTime")), epoch(fields.get("SubmitTime"))
            if begin and submitted:
                holds.append(begin - submitted)
            slurm("scontrol", "update", f"jobid={job_id}", "StartTime=now")
            released = restarts
        if state == "RUNNING":
            on_running(fields)
        if time.monotonic() > deadline:
            return "TIMEOUT(bench)", holds  # run_job cancels it
        time.sleep(0.5)


def read_timeline(root):
    records = []
    with contextlib.suppress(FileNotFoundError), open(os.path.join(root, "timeline.jsonl")) as f:
        for line in f:
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records


def trigger(case, root, job_id, fired):
    """The outside fault of node_lost / preemption, once attempt 0 is past FAULT_STEP."""
    def on_running(fields):
        if fired or not any(r["ev"] == "step" and r.get("attempt") == 0 and r["step"] >= FAULT_STEP
                            for r in read_timeline(root)):
            return
        if case == "node_lost":
            node = slurm("scontrol", "show", "hostnames", fields["NodeList"]).split()[-1]
            fired.append(time.time())
            crash_node(node)
        else:
            fired.append(time.time())
            slurm("scancel", "--signal=TERM", job_id)
    return on_running


def cancel(job_id):
    """scancel a job that has not ended, and wait (60 s at most) until Slurm says it has."""
    for _ in range(120):
        if show(job_id).get("JobState", "") in FINAL_STATES | {""}:
            return
        slurm("scancel", job_id, check=False)
        time.sleep(0.5)


def kill_leftovers(job_id):
    """SIGKILL any process that still carries the job's id (Slurm's proctrack should leave none)."""
    for pid in _pids():
        if pid != os.getpid() and _environ(pid).get("SLURM_JOB_ID") == job_id:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def sacct_wall(job_id):
    """First attempt's start to the last one's end (1 s resolution), once slurmdbd has it."""
    for _ in range(40):
        rows = [[epoch(t) for t in line.split("|")] for line in slurm(
            "sacct", "-j", job_id, "--duplicates", "-X", "-n", "-P", "-o", "Start,End", check=False).split()]
        rows = [row for row in rows if len(row) == 2 and row[0]]  # attempts that started
        if rows and all(end for _, end in rows):
            return max(end for _, end in rows) - min(start for start, _ in rows)
        time.sleep(0.5)
    return None


def run_job(name, case, peer_bin, keep):
    """One job under `name`, start to end, holding the cluster; what it measured. Its directory
    (timeline, NeMo-Run's scripts and logs) is kept when it did not recover or finish."""
    root = tempfile.mkdtemp(prefix=f"nvrx-bench-slurm-{name}-{case}-")
    fired, job_id, job_dir, state, holds = [], None, root, "NOT SUBMITTED", []
    with exclusive():
        try:
            job_id, job_dir = submit(name, case, root, peer_bin)
            on_running = trigger(case, root, job_id, fired) if case != "kill" else lambda _: None
            state, holds = follow(job_id, root, on_running)
        finally:
            if job_id:
                cancel(job_id)  # a timed-out or interrupted job; nothing for one that ended
                kill_leftovers(job_id)
            if case == "node_lost" and fired:
                nodes_back()
    result = measure(name, root, job_id, job_dir, state, holds, fired)
    if not keep and result["finished"] and result["recovery"] is not None:
        shutil.rmtree(root, ignore_errors=True)
    return result


def measure(name, root, job_id, job_dir, state, holds, fired):
    """The job's figures from its timeline, NeMo-Run's files, Slurm and (ours) the events file."""
    records = read_timeline(root)
    t_fault = fired[0] if fired else next((r["t"] for r in records if r["ev"] == "fault"), None)
    new_pids = {r["pid"] for r in records if r["ev"] == "started" and t_fault is not None and r["t"] > t_fault}
    after = [r["t"] for r in records if r["ev"] == "step" and r["pid"] in new_pids]
    durations, last = [], {}  # rank 0's step times, within each process
    for r in sorted((r for r in records if r["ev"] in ("started", "step") and r.get("rank", 0) == 0),
                    key=lambda r: r["t"]):
        if r["ev"] == "step" and r["pid"] in last:
            durations.append(r["t"] - last[r["pid"]])
        last[r["pid"]] = r["t"]
    finished = (sum(1 for r in records if r["ev"] == "done") >= 4
                and {r["step"] for r in records if r["ev"] == "step"} >= set(range(1, STEPS + 1)))
    wall = sacct_wall(job_id) if job_id else None
    out = {"recovery": (min(after) - t_fault) if after and t_fault else None, "state": state, "holds": holds,
           "finished": finished, "ettr": STEPS * statistics.median(durations) / wall if finished and durations
           and wall else None, "attempts": None, "exits": [], "report": None, "incidents": None, "longest": None,
           "job_id": job_id, "root": root, "restarted": len(new_pids),
           "requeues": int(show(job_id).get("Restarts", 0)) if job_id else None,
           "preempted": sorted(r["step"] for r in records if r["ev"] == "preempted")}
    if os.path.exists(os.path.join(job_dir, "job_job_results")):
        with open(os.path.join(job_dir, "job_job_results")) as f:
            out["attempts"] = "".join(line.split()[2] for line in f if line.strip())
    for log in sorted(n for n in os.listdir(job_dir) if n.startswith("sbatch_")) if os.path.isdir(job_dir) else []:
        with open(os.path.join(job_dir, log)) as f:  # NeMo-Run's template echoes srun's status, each attempt
            out["exits"] += [int(code) for code in re.findall(r"^job exited with code (\d+)$", f.read(), re.M)]
    if name == "ours" and os.path.exists(os.path.join(root, "events.jsonl")):
        from nvrx_core.report.build import build_report

        with contextlib.suppress(Exception):
            built = build_report(os.path.join(root, "events.jsonl"))
            out["report"], out["incidents"] = built.goodput.ettr, len(built.incidents)
            out["longest"] = max((end - begin for _, _, begin, end, kept in built.goodput.executions if kept),
                                 default=None)
    return out


def fmt(value, unit):
    if value is None:
        return "none"
    return f"{value * 100:.1f}%" if unit == "%" else f"{value:.2f} s"


def median_of(results, key):
    values = [r[key] for r in results]
    return statistics.median(values) if values and None not in values else None


def compare(measure_name, unit, results, names, notes):
    ours = median_of(results["ours"], measure_name.split(":")[0])
    for name in names[1:]:
        peer = median_of(results[name], measure_name.split(":")[0])
        ratio = f"{ours / peer:.2f}" if ours and peer else "n/a"
        print(f"slurm_{measure_name.split(':')[1]}: ours {fmt(ours, unit)}{notes.get('ours', '')}, {LABEL[name]} "
              f"{fmt(peer, unit)}{notes.get(name, '')}, ratio {ratio}", flush=True)


def failed_attempt(r):
    """Did the preempted attempt count as failed? NeMo-Run's results file says, for a fault-tolerant
    launcher; torchrun's template keeps none and requeues only a non-zero exit, each using a retry."""
    if r["attempts"]:
        return f"{'yes' if r['attempts'][0] == 'F' else 'no'} ({r['attempts']}, exits {r['exits']})"
    if r["exits"]:
        return f"{'yes' if r['exits'][0] else 'no'} (no results file; exits {r['exits']}: a non-zero exit uses a retry)"
    return "unknown (no results file, no exit recorded)"


def print_case(case, results, names):
    for name in names:
        rs = results[name]
        print(f"  {name:8s} {case:10s} runs: [{', '.join(fmt(r['recovery'], 's') for r in rs)}] states "
              f"{[r['state'] for r in rs]} requeues {[r['requeues'] for r in rs]} finished "
              f"{[r['finished'] for r in rs]} ETTR [{', '.join(fmt(r['ettr'], '%') for r in rs)}]", flush=True)
        for r in rs:
            if not r["finished"] or r["recovery"] is None:
                print(f"    job {r['job_id']} did not recover or finish ({r['state']}, {r['requeues']} requeues, "
                      f"{r['restarted']} processes started after the fault reached training): kept {r['root']}",
                      flush=True)
    notes = {}
    for name in names if case == "kill" else []:  # a fault inside the job that still needed a requeue
        requeued = sum(1 for r in results[name] if r["requeues"])
        if requeued:
            notes[name] = f" ({requeued}/{len(results[name])} jobs requeued: in-job restarts failed)"
    compare(f"recovery:{case}_recovery", "s", results, names, notes)
    compare(f"ettr:ettr_{case}", "%", results, names, notes)
    ours = results["ours"]
    print(f"slurm_ettr_{case}_report: ours nvrx report {fmt(median_of(ours, 'report'), '%')} (incidents found "
          f"{[r['incidents'] for r in ours]}, longest step it kept [{', '.join(fmt(r['longest'], 's') for r in ours)}]"
          f"), ours timeline {fmt(median_of(ours, 'ettr'), '%')}", flush=True)
    for name in names if case == "preemption" else []:
        steps = [r["preempted"] for r in results[name]]
        same = all(len(s) == 4 and len(set(s)) == 1 for s in steps)
        print(f"slurm_preemption_failed_attempt: {LABEL[name]} {'; '.join(failed_attempt(r) for r in results[name])}"
              f"; every rank saved at one step: {same} {steps}", flush=True)


def check_peer(peer_bin):
    """Does the peer's ft_launcher take the flags NeMo-Run writes (parsed up to --help)?"""
    flags = subprocess.run([os.path.join(peer_bin, "ft_launcher"), "--ft-workload_check_interval", "5",
                            "--ft-initial_rank_heartbeat_timeout", "120", "--ft-rank_heartbeat_timeout", "10",
                            "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29500",
                            "--rdzv-id", "1", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "0", "--tee",
                            "3", "--help"], capture_output=True, text=True, timeout=120)
    flags_ok = "accepted" if flags.returncode == 0 else "REFUSED: " + flags.stderr[-300:]
    print(f"peer ft_launcher: NeMo-Run's flags {flags_ok}; it ignores our plugin's ${FT_CONFIG_ENV} (the same "
          "heartbeat timeouts reach it as NeMo-Run's flags)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-python", default=None, help="python of the venv with nvidia-resiliency-ext 0.4.1")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one run of each (a smoke test)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--keep", action="store_true", help="keep every job's directory (timeline, logs), not "
                        "only those of jobs that did not recover or finish")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    # a SIGTERM (a CI timeout, kill) unwinds like Ctrl-C: each job's finally cancels it, kills
    # what is left of it and brings a crashed node back
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.update(cluster_env())
    peer_bin = os.path.dirname(os.path.abspath(args.peer_python)) if args.peer_python else None
    names = ["ours", "torchrun"]
    if peer_bin and os.path.exists(os.path.join(peer_bin, "ft_launcher")):
        check_peer(peer_bin)
        names.append("nvrx")
    else:
        print("nvidia-resiliency-ext venv not found (--peer-python): comparing with torchrun only")
    print("ETTR: steps x the job's median step / Slurm's span of the job (sacct, 1 s: first attempt's start to the "
          "last one's end); nvrx report's wall is its launchers' span", flush=True)
    holds = []
    for case in args.cases.split(","):
        results = {name: [run_job(name, case, peer_bin, args.keep) for _ in range(runs)] for name in names}
        holds += [h for rs in results.values() for r in rs for h in r["holds"]]
        print_case(case, results, names)
    if holds:
        print(f"requeue hold: Slurm held each requeued job {statistics.median(holds):.0f} s (median of {len(holds)}, "
              f"StartTime - SubmitTime); the bench released each one {RELEASE_AFTER:.0f} s after its requeue "
              f"(scontrol update StartTime=now), so node_lost and preemption above exclude it", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
