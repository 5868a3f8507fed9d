"""The Slurm benchmark's job: 4 gloo ranks (2 nodes x 2), ~75 ms steps, checkpoint every 10 steps.

Depends on torch only (plus the heartbeat client it is told to use), so the same file runs under
our ft_launcher, torchrun and nvidia-resiliency-ext's ft_launcher, each with its own python
(whatever `python` the job's PATH finds). Modeled on bench/_toy_job.py, with what a Slurm job
needs on top:
- the attempt (SLURM_RESTART_COUNT) and node in each `started` record, so bench/slurm.py can
  tell attempts apart in one JSON-lines timeline ({"t": time.time(), "ev": ...}) that every
  attempt appends to;
- a SIGTERM handler (Slurm's `--signal` and `scancel --signal=TERM` reach every process of the
  step): each step the ranks agree on "stop now" with an all_reduce of a flag, so every rank
  stops after the same step, rank 0 saves there, and all exit 18 (preempted, requeue me). It is
  installed only once training starts, as Megatron's exit handler is: a launcher stopping its
  workers (torchrun restarting the group, SIGTERM then SIGKILL 30 s later) must not find a rank
  still in init_process_group that waits for the next step to end;
- the finished flag (FAULT_TOL_FINISHED_FLAG_FILE) when training completes: NeMo-Run's Slurm
  template requeues a fault-tolerant job until the flag exists.
Hydra-style arguments NeMo-Run's plugins append to a Script (`ft.enable_ft_package=true` ...)
are ignored: the job takes only its own flags.
"""
import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from _job_parts import heartbeat_client, model_from, recorder

p = argparse.ArgumentParser()
p.add_argument("--client", choices=("ours", "nvrx", "none"), default="none")
p.add_argument("--fault", choices=("none", "kill"), default="none")
p.add_argument("--fault-step", type=int, default=15)
p.add_argument("--fault-rank", type=int, default=1)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--step-time", type=float, default=0.075)
p.add_argument("--workdir", required=True)
args, _plugin_overrides = p.parse_known_args()

timeline = os.path.join(args.workdir, "timeline.jsonl")
marker = os.path.join(args.workdir, "fault.marker")
ckpt = os.path.join(args.workdir, "ckpt.pt")
attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)

record = recorder(timeline)

stop_requested = []


def on_sigterm(signum, frame):
    # only note it: the ranks agree on the step at the next all_reduce
    if not stop_requested:
        stop_requested.append(time.time())


client = heartbeat_client(args.client)

dist.init_process_group("gloo")
rank = dist.get_rank()
model, opt, start = model_from(ckpt)


def save(step):
    torch.save({"model": model.state_dict(), "step": step}, ckpt + ".tmp")
    os.replace(ckpt + ".tmp", ckpt)


signal.signal(signal.SIGTERM, on_sigterm)
record("started", rank=rank, step=start, attempt=attempt, node=os.environ.get("SLURMD_NODENAME", ""))
for step in range(start + 1, args.steps + 1):
    t0 = time.monotonic()
    if args.fault == "kill" and rank == args.fault_rank and step == args.fault_step and not os.path.exists(marker):
        open(marker, "w").close()
        record("fault", kind="kill", rank=rank, step=step)
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.randn(32, 256)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)
    opt.step()
    time.sleep(max(0.0, args.step_time - (time.monotonic() - t0)))
    flag = torch.tensor([1.0 if stop_requested else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if client is not None:
        client.send_heartbeat()
        if hasattr(client, "report_progress"):  # ours: rank 0's step_done events time the steps for nvrx report
            client.report_progress(step)
    if rank == 0:
        record("step", step=step, attempt=attempt)
    if flag.item() > 0:
        if rank == 0:
            save(step)
        dist.barrier()
        record("preempted", rank=rank, step=step, signal_t=stop_requested[0] if stop_requested else None)
        if client is not None:
            client.shutdown_workload_monitoring()
        dist.destroy_process_group()
        sys.exit(18)
    if step % 10 == 0 and rank == 0:
        save(step)
    if step % 10 == 0:
        dist.barrier()
record("done", rank=rank, attempt=attempt)
if rank == 0 and os.environ.get("FAULT_TOL_FINISHED_FLAG_FILE"):
    flag_file = os.environ["FAULT_TOL_FINISHED_FLAG_FILE"]
    with open(flag_file + ".tmp", "w") as f:
        f.write("finished\n")
    os.replace(flag_file + ".tmp", flag_file)
if client is not None:
    client.shutdown_workload_monitoring()
dist.destroy_process_group()
