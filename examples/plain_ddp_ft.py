"""Plain DDP training with nvrx-suite fault tolerance: what a script adds to run under ft_launcher.

    ft_launcher --nproc-per-node 2 --max-restarts 3 \
        --ft-rank-section-timeouts setup:600,step:60,checkpointing:300 \
        examples/plain_ddp_ft.py --ckpt-dir /tmp/ddp_ft

The same script runs under torchrun or plain python too; the client then says that
hang detection is inactive and does nothing.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nvrx_core.durable import atomic_write_with
from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.ft.finished import write_finished_flag

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", required=True)
parser.add_argument("--steps", type=int, default=200)
args = parser.parse_args()

ft = RankMonitorClient()
ft.init_workload_monitoring()          # connects to ft_launcher's node monitor
ft.load_state(args.ckpt_dir)           # timeouts learned in an earlier cycle, if any

with ft.section("setup"):              # a hang here is caught after the 'setup' timeout
    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(32, 32))
    opt = torch.optim.AdamW(model.parameters())
    ckpt = os.path.join(args.ckpt_dir, "model.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]

for step in range(start + 1, args.steps + 1):
    with ft.section("step"):
        loss = model(torch.randn(8, 32)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    ft.report_progress(step)           # lets the launcher stop a restart loop that makes no progress
    if step == start + 20:
        ft.calculate_and_set_timeouts()  # tighten timeouts to 5x what this job really needs
    if step % 50 == 0 or step == args.steps:
        with ft.section("checkpointing"):
            if dist.get_rank() == 0:
                state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
                atomic_write_with(ckpt, lambda f: torch.save(state, f))
                ft.save_state(args.ckpt_dir)   # keep the learned timeouts with the checkpoint
            dist.barrier()

if dist.get_rank() == 0:
    write_finished_flag()              # a resubmitted job (FAULT_TOL_FINISHED_FLAG_FILE) exits at once
ft.shutdown_workload_monitoring()
dist.destroy_process_group()
