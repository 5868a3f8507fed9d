"""In-process restart: seconds from a fault to the first step completed after recovery.

The same toy job (4 gloo ranks, DDP over a 2-layer MLP, ~50 ms steps, 40 steps; rank 1
raises an exception at step 15, once) recovers four ways:
- ours:           nvrx_core.inprocess.Wrapper, under our ft_launcher (its agent store);
                  the state is kept in memory, the function is called again;
- ft_launcher:    our launcher restarts every process (warm fork server), the job reloads
                  its checkpoint (saved every 10 steps);
- torchrun:       the same, with torchrun;
- nvrx-0.4.1:     nvidia-resiliency-ext's inprocess.Wrapper on the same job, in its own
                  venv (--peer-python), under that venv's torchrun.
Medians of --runs runs. Prints `inprocess_recovery: ours X s, peer(<name>) Y s, ratio Z`.

    python bench/inprocess.py --peer-python .venv-peer/bin/python [--runs 3]

The same file is the job: `bench/inprocess.py --bench-worker --bench-mode plain|ours|peer ...`.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _baseline import Baseline
from _process import run_group

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
WORLD, STEPS, FAULT_STEP, FAULT_RANK, STEP_TIME, CKPT_EVERY = 4, 40, 15, 1, 0.05, 10
PEER_HARD_TIMEOUT = 15


# ---- the job (runs in each rank; imports only torch and the restart library of its mode) ----
def record(workdir, event, **fields):
    line = json.dumps({"t": time.time(), "ev": event, "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(os.path.join(workdir, "timeline.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, line.encode())
    os.close(fd)


def train_steps(workdir, model_state, start, generation, rank, world):
    """Steps start..STEPS of DDP training; the process group already exists. Returns the model."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    if model_state is not None:
        model.load_state_dict(model_state)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    marker = os.path.join(workdir, "fault.marker")
    for step in range(start + 1, STEPS + 1):
        began = time.monotonic()
        if rank == FAULT_RANK and step == FAULT_STEP and not os.path.exists(marker):
            open(marker, "w").close()
            record(workdir, "fault", step=step)
            raise RuntimeError("injected exception")
        data = torch.randn(32, 256, generator=torch.Generator().manual_seed(step * world + rank))
        loss = ddp(data).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(max(0.0, STEP_TIME - (time.monotonic() - began)))
        if rank == 0:
            record(workdir, "step", step=step, generation=generation)
        yield step, model
    dist.barrier()


def worker_plain(workdir):
    """Process-level restarts: reload the last checkpoint, like any job under torchrun."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = os.path.join(workdir, "ckpt.pt")
    state, start = None, 0
    if os.path.exists(ckpt):
        saved = torch.load(ckpt, weights_only=True)
        state, start = saved["model"], saved["step"]
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step, model in train_steps(workdir, state, start, generation, rank, world):
        if rank == 0 and step % CKPT_EVERY == 0:
            torch.save({"model": model.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    dist.destroy_process_group()


def worker_ours(workdir):
    from nvrx_core.inprocess import RestartState, Wrapper

    memory = {"model": None, "step": 0}

    @Wrapper(soft_timeout=20, hard_timeout=30, heartbeat_timeout=20, barrier_timeout=60, monitor_interval=0.5)
    def train(state: RestartState):
        state.init_process_group("gloo")
        start, saved = memory["step"], memory["model"]
        for step, model in train_steps(workdir, saved, start, state.iteration, state.rank, state.world_size):
            memory["model"], memory["step"] = {k: v.clone() for k, v in model.state_dict().items()}, step

    train()


def worker_peer(workdir):
    from datetime import timedelta

    import torch.distributed as dist
    from nvidia_resiliency_ext import inprocess

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    base_store = dist.TCPStore(os.environ["MASTER_ADDR"], port + 2, world, is_master=rank == 0,
                               multi_tenant=True, wait_for_workers=True)
    memory = {"model": None, "step": 0}

    @inprocess.Wrapper(store_kwargs={"port": port + 1}, soft_timeout=timedelta(seconds=PEER_HARD_TIMEOUT - 5),
                       hard_timeout=timedelta(seconds=PEER_HARD_TIMEOUT), heartbeat_timeout=timedelta(seconds=20),
                       barrier_timeout=timedelta(seconds=60), completion_timeout=timedelta(seconds=60),
                       health_check=None)
    def train(call_wrapper: inprocess.CallWrapper = None):
        store = dist.PrefixStore(f"iteration{call_wrapper.iteration}", base_store)
        dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
        start, saved = memory["step"], memory["model"]
        for step, model in train_steps(workdir, saved, start, call_wrapper.iteration, dist.get_rank(),
                                       dist.get_world_size()):
            memory["model"], memory["step"] = {k: v.clone() for k, v in model.state_dict().items()}, step
        dist.destroy_process_group()

    train()


# ---- the driver ---------------------------------------------------------------------------
def command(name, peer_python, workdir):
    job = [HERE, "--bench-worker", "--bench-workdir", workdir]
    common = ["--nproc-per-node", str(WORLD)]
    if name == "ours":
        return [sys.executable, "-m", "nvrx_core.ft.command", *common, "--max-restarts", "0", *job, "--bench-mode", "ours"]
    if name == "ft_launcher":
        return [sys.executable, "-m", "nvrx_core.ft.command", *common, "--max-restarts", "3", *job, "--bench-mode", "plain"]
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", *common, "--max-restarts", "3", *job,
                "--bench-mode", "plain"]
    return [peer_python, "-m", "torch.distributed.run", "--standalone", *common, "--max-restarts", "0", *job,
            "--bench-mode", "peer"]


def run_once(name, peer_python, limit=40.0, baseline=None):
    """One job (a fault-free job takes ~10 s here; a recovered one well under 30 s)."""
    workdir = tempfile.mkdtemp(prefix=f"nvrx-bench-inprocess-{name}-")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=REPO)
    env["NVRX_EVENTS_FILE"] = os.path.join(workdir, "events.jsonl")
    log_path = os.path.join(workdir, "launcher.log")
    cmd, cwd = command("ours" if baseline else name, peer_python, workdir), REPO
    if baseline is not None:
        cmd, env, cwd = baseline.command(cmd), baseline.env(env), baseline.tree
    with open(log_path, "w") as log:
        code = run_group(cmd, log, env, limit, cwd=cwd)
    records = []
    if os.path.exists(os.path.join(workdir, "timeline.jsonl")):
        with open(os.path.join(workdir, "timeline.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    fault = next((r["t"] for r in records if r["ev"] == "fault"), None)
    after = [r["t"] for r in records if r["ev"] == "step" and r.get("generation", 0) >= 1]
    last_step = max((r["step"] for r in records if r["ev"] == "step"), default=0)
    with open(log_path, errors="replace") as f:
        log = f.read()[-1_000_000:]
    shutil.rmtree(workdir, ignore_errors=True)
    recovery = (min(after) - fault) if fault is not None and after else None
    return {"recovery": recovery, "exit": code, "finished": code == 0 and last_step == STEPS, "log": log}


def median_recovery(name, peer_python, runs, stop_after_failure=False, baseline=None):
    """(median of the recovered runs or None, every run's result)."""
    results = []
    for _ in range(runs):
        results.append(run_once(name, peer_python, baseline=baseline))
        if stop_after_failure and results[-1]["recovery"] is None:
            break
    shown = ", ".join(f"{r['recovery']:.2f}" if r["recovery"] is not None else "none" for r in results)
    times = [r["recovery"] for r in results if r["recovery"] is not None]
    print(f"  {name:12s} runs: [{shown}] s, exit codes {[r['exit'] for r in results]}, "
          f"recovered {len(times)}/{len(results)}, finished {sum(r['finished'] for r in results)}/{len(results)}",
          flush=True)
    return (statistics.median(times) if times else None), results


def peer_problem(peer_python):
    """Why the peer cannot be measured, or None."""
    if not peer_python:
        return "no --peer-python given"
    if not os.path.exists(peer_python):
        return f"--peer-python {peer_python} does not exist"
    probe = subprocess.run([peer_python, "-c", "import nvidia_resiliency_ext.inprocess"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"nvidia_resiliency_ext.inprocess does not import: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def explain_peer_failure(result):
    """What a failed peer run showed, in words (its own logging is off unless configured)."""
    log = result["log"]
    if "exitcode  : -15" in log or "exitcode: -15" in log:
        seen = ("ranks still blocked in the gloo all-reduce were killed by its hard timeout "
                f"({PEER_HARD_TIMEOUT} s) and torchrun ended the job")
    elif result["exit"] is None:
        seen = "the job did not finish within the time limit"
    else:
        seen = f"the job exited with {result['exit']}"
    return (f"it does not recover on CPU/gloo: after the exception, {seen}. Its abort "
            "(AbortTorchDistributed) aborts only NCCL backends and then calls destroy_process_group, which "
            "does not release a rank waiting in a gloo collective, so the other ranks never leave the failed step")


def fmt(value):
    return f"{value:.2f} s" if value is not None else "no recovery"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-python", default=None, help="python of the venv with nvidia-resiliency-ext 0.4.1")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", metavar="REV", help="also measure ours at this git revision, as a peer")
    parser.add_argument("--bench-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bench-mode", choices=("plain", "ours", "peer"), help=argparse.SUPPRESS)
    parser.add_argument("--bench-workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bench_worker:
        {"plain": worker_plain, "ours": worker_ours, "peer": worker_peer}[args.bench_mode](args.bench_workdir)
        return 0
    print(f"toy job: {WORLD} gloo ranks, DDP, {STEP_TIME * 1000:.0f} ms steps; rank {FAULT_RANK} raises at step "
          f"{FAULT_STEP}; seconds from the fault to the first step after recovery, median of {args.runs}", flush=True)
    ours, _ = median_recovery("ours", args.peer_python, args.runs)
    peers, notes = {}, {}
    for name in ("ft_launcher", "torchrun"):
        value, results = median_recovery(name, args.peer_python, args.runs)
        peers[f"{name} restart"] = value
        recovered = sum(r["recovery"] is not None for r in results)
        if recovered < len(results):
            stale = any("connectFullMesh failed" in r["log"] or "Connection refused" in r["log"] for r in results)
            why = (": restarted workers tried to connect to gloo addresses nobody listens on, stale keys in "
                   "torchrun's reused store (pytorch#135712)") if stale else ""
            notes[f"{name} restart"] = f" ({recovered}/{len(results)} runs recovered{why})"
    if args.baseline:
        baseline = Baseline(args.baseline)
        try:
            peers[baseline.label], _ = median_recovery(baseline.label, args.peer_python, args.runs, baseline=baseline)
        finally:
            baseline.close()
    peer_name = "nvrx-0.4.1 inprocess.Wrapper"
    problem = peer_problem(args.peer_python)
    if problem is None:
        value, results = median_recovery("nvrx-0.4.1", args.peer_python, args.runs, stop_after_failure=True)
        if value is not None and len(results) == args.runs:
            peers[peer_name] = value
        else:
            problem = explain_peer_failure(next(r for r in results if r["recovery"] is None))
    for name, value in peers.items():
        ratio = f"{ours / value:.2f}" if ours is not None and value is not None else "n/a"
        print(f"inprocess_recovery: ours {fmt(ours)}, peer({name}) {fmt(value)}{notes.get(name, '')}, ratio {ratio}",
              flush=True)
    if peer_name not in peers:
        print(f"inprocess_recovery: ours {fmt(ours)}, peer({peer_name}) not measured: {problem}", flush=True)
    launcher = peers["ft_launcher restart"]
    met = ours is not None and ours <= 1.0 and launcher is not None and launcher >= 3 * ours
    print(f"acceptance (ours <= 1.0 s and >= 3x faster than ft_launcher restart): {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
