"""The recovery benchmark's toy job: 2 gloo ranks, ~50 ms steps, checkpoint every 10 steps.

Depends on torch only (plus the FT client it is told to use), so the same file runs under
torchrun, nvidia-resiliency-ext's ft_launcher (in its own venv) and ours. It appends JSON
lines {"t", "ev", ...} to --timeline: the benchmark reads fault time and step times there.
A fault fires once per job: the faulty rank creates --fault-marker first.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

from _job_parts import heartbeat_client, model_from, recorder

p = argparse.ArgumentParser()
p.add_argument("--client", choices=("ours", "nvrx", "none"), default="none")
p.add_argument("--fault", choices=("none", "kill", "hang", "exception"), default="none")
p.add_argument("--fault-step", type=int, default=15)
p.add_argument("--fault-rank", type=int, default=1)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--workdir", required=True)
args = p.parse_args()

timeline = os.path.join(args.workdir, "timeline.jsonl")
marker = os.path.join(args.workdir, "fault.marker")
ckpt = os.path.join(args.workdir, "ckpt.pt")

record = recorder(timeline)
client = heartbeat_client(args.client)

dist.init_process_group("gloo")
rank = dist.get_rank()
model, opt, start = model_from(ckpt)
record("started", rank=rank, step=start)
for step in range(start + 1, args.steps + 1):
    t0 = time.monotonic()
    if args.fault != "none" and rank == args.fault_rank and step == args.fault_step and not os.path.exists(marker):
        open(marker, "w").close()
        record("fault", kind=args.fault, rank=rank, step=step)
        if args.fault == "kill":
            os.kill(os.getpid(), 9)
        elif args.fault == "exception":
            raise RuntimeError("injected exception")
        else:
            while True:
                time.sleep(3600)
    x = torch.randn(32, 256)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)
    opt.step()
    time.sleep(max(0.0, args.step_time - (time.monotonic() - t0)))
    if client is not None:
        client.send_heartbeat()
    if rank == 0:
        record("step", step=step)
    if step % 10 == 0 and rank == 0:
        torch.save({"model": model.state_dict(), "step": step}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
    if step % 10 == 0:
        dist.barrier()
record("done", rank=rank)
if client is not None:
    client.shutdown_workload_monitoring()
dist.destroy_process_group()
