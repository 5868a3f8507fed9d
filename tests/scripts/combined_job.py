"""The fault-tolerance client, the in-process Wrapper, the async checkpointer and the
preemption handler in one rank, under ft_launcher: every signal they use is claimed through
the one registry, they work together through an in-process restart, and each gives its
signals back.

argv: OUT_DIR. Rank 1 raises at step 7 of iteration 0 (after the step-5 checkpoint); the
Wrapper restarts the function in-process, which resumes from the checkpoint. Each rank
writes OUT_DIR/rank{R}.json.
"""
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

from nvrx_core.checkpoint import AsyncCheckpointer, CheckpointNotFoundError
from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.inprocess import RestartState, Wrapper
from nvrx_core.preemption import DistributedSignalHandler, PreemptionConfig
from nvrx_core.signals import SignalClaimError, default_registry

STEPS, FAULT_STEP, SAVE_EVERY = 12, 7, 5
out = sys.argv[1]
rank = int(os.environ["RANK"])
registry = default_registry()
report = {"iterations": [], "conflict": None}

client = RankMonitorClient()
client.init_workload_monitoring()
wrapper = Wrapper(soft_timeout=10, hard_timeout=20, heartbeat_interval=0.5, heartbeat_timeout=15,
                  monitor_interval=0.2, barrier_timeout=60)


@wrapper
def train(state: RestartState):
    state.init_process_group("gloo")  # each iteration's group: the preemption handler agrees over it
    with DistributedSignalHandler(PreemptionConfig(signals=["SIGTERM"], check_every_n_steps=1)) as preemption:
        return train_steps(state, preemption)


def train_steps(state: RestartState, preemption: DistributedSignalHandler) -> str:
    report["owners_inside"] = registry.owners()
    try:  # a second owner of the Wrapper's interrupt signal is refused, naming both
        DistributedSignalHandler(PreemptionConfig(signals=["SIGUSR1"])).install()
    except SignalClaimError as e:
        report["conflict"] = str(e)
    ckpt = AsyncCheckpointer(os.path.join(out, "ckpt"))
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    try:
        start, saved = ckpt.load_latest()
        model.load_state_dict(saved["model"])
    except CheckpointNotFoundError:
        start = 0
    report["iterations"].append({"iteration": state.iteration, "resumed_at": start})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(start + 1, STEPS + 1):
        if state.iteration == 0 and rank == 1 and step == FAULT_STEP:
            raise RuntimeError("injected fault")
        data = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        loss = model(data).square().mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        client.send_heartbeat()
        client.report_progress(step)
        if preemption.should_stop(step):  # never signalled here: it only has to agree every step
            raise SystemExit("preempted")
        if step % SAVE_EVERY == 0:
            ckpt.save({"model": model.state_dict()}, step)
            ckpt.finalize(blocking=True)
    ckpt.close()
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


report["checksum"] = train()
report["owners_after_wrapper"] = registry.owners()
client.shutdown_workload_monitoring()
report["owners_at_end"] = registry.owners()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
